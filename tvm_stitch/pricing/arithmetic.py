"""A thread's arithmetic in a lowered CUDA kernel, by math unit (the time model's `flops`).

FMA pipe: each floating-point add, subtract and multiply of a float32,
float16 or bfloat16 value counts per lane; an add or subtract of a product
is one FMA with it. Every FMA-pipe instruction counts as two operations (an
FMA's multiply and add; a lone add or multiply takes an FMA's issue slot),
so the count over the unit's peak (in FLOP/s) is its time.
Tensor cores: an mma instruction of a warp counts 2 x m x n x k operations
shared by its 32 threads; `tirx.ptx_legacy.mma` names its shape
("m16n8k16") and input dtype, `tirx.tvm_mma_sync` (wmma) takes a fragment
of m x n x k = 4096 (16x16x16, 32x8x16, 8x32x16; TF32's 16x16x8: 2048), its
dtype the fragment buffer's.
"""

from __future__ import annotations

import re
from types import MappingProxyType

import tvm
from tvm import tirx

ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul)
MMA_OPS = ("tirx.ptx_legacy.mma", "tirx.tvm_mma_sync")
WARP = 32  # threads sharing one mma instruction
FMA_UNITS = MappingProxyType({"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"})
TENSOR_UNITS = MappingProxyType({"fp16": "fp16_tc", "float16": "fp16_tc", "bf16": "bf16_tc", "bfloat16": "bf16_tc",
                                 "tf32": "tf32_tc", "float32": "tf32_tc", "int8": "int8_tc", "uint8": "int8_tc",
                                 "s8": "int8_tc", "u8": "int8_tc"})
WMMA_ELEMENTS = 4096  # m x n x k of a 16-bit or 8-bit wmma fragment
WMMA_TF32_ELEMENTS = 2048


def _dtype(expr) -> tuple:
    """(scalar dtype, lanes) of an expression."""
    text = str(expr.ty.dtype)
    match = re.fullmatch(r"([a-z]+\d+)(?:x(\d+))?", text)
    return (match.group(1), int(match.group(2) or 1)) if match else (text, 1)


def _fused(node) -> bool:
    """An add or subtract whose operand is a floating-point product: the product's FMA."""
    return isinstance(node, (tirx.Add, tirx.Sub)) and any(isinstance(x, tirx.Mul) for x in (node.a, node.b))


def _mma(node) -> tuple | None:
    """(unit, operations per thread) of one mma instruction; None where it cannot be read."""
    if node.op.name == "tirx.ptx_legacy.mma":
        shape = re.fullmatch(r"m(\d+)n(\d+)k(\d+)", str(node.args[0].value))
        dtype = str(node.args[3].value)
        if shape is None or dtype not in TENSOR_UNITS:
            return None
        m, n, k = (int(x) for x in shape.groups())
        return TENSOR_UNITS[dtype], 2.0 * m * n * k / WARP
    pointer = getattr(node.args[2], "ty", None)  # the A fragment's data: a pointer to its dtype
    element = getattr(pointer, "element_type", None)
    dtype = str(getattr(element, "dtype", element)) if element is not None else "float16"
    unit = TENSOR_UNITS.get(dtype, "fp16_tc")
    elements = WMMA_TF32_ELEMENTS if unit == "tf32_tc" else WMMA_ELEMENTS
    return unit, 2.0 * elements / WARP


def add_arithmetic(flops: dict, node, times: float) -> None:
    """Add to `flops` (unit -> operations per thread) what `node` computes, evaluated `times` times."""
    if isinstance(node, tvm.ir.Call):
        found = _mma(node)
        if found is not None:
            flops[found[0]] = flops.get(found[0], 0.0) + found[1] * times
        return
    dtype, lanes = _dtype(node)
    unit = FMA_UNITS.get(dtype)
    if unit is None or _fused(node):
        return  # integer index arithmetic; an add of a product is counted with its multiply
    flops[unit] = flops.get(unit, 0.0) + 2.0 * lanes * times
