"""Registers per thread of a scheduled GEMM's kernels, estimated from the lowered TIR, against the cap that
the block's size imposes: a schedule over the cap would spill, and is no candidate (pricing/gemm_choice.py).

A thread of a GEMM holds its tiles in registers. The PrimFunc is lowered as
for the time model (kernel_geometry.device_kernels) and each kernel's
allocations private to a thread or a warp are counted in 32-bit registers
per thread:
- `local`: the whole buffer (elements times lanes times bytes);
- `warp` (the tensor-core rule's mma fragments, [..., lanes, elements]) and
  `wmma.accumulator` (dlight's): the buffer over the warp's lanes;
- `wmma.matrix_a` and `wmma.matrix_b`: twice that, a 16x16x16 float16
  operand fragment holding 16 elements per lane (each element in two
  lanes' registers) where a warp's share is 8.
The estimate adds ADDRESS_REGISTERS (indices, pointers, loop counters, the
copies' staging) to the sum. The cap: a kernel compiled under
`__launch_bounds__(threads)` (TVM writes the block's threads there) keeps
one block resident, so ptxas allots at most the SM's registers over the
block's threads, rounded down to the allocation granule per thread, and at
most TargetSpec.max_registers_per_thread.

Calibrated against `ptxas -v` (nvcc 13, sm_80 and sm_90) on the GEMM
kernels of BERT, GPT-2 and LLaMA at bench size in float16, forward and
backward, each scheduled both ways (340 compilations). Kernels without a
binding cap (the rule's 128 threads, dlight's FMA Matmul of 128; cap 255)
used 8 to 80 registers beyond their fragments, median 32, under 24 in 48 of
216: ADDRESS_REGISTERS is a floor rather than a mean, and the estimate errs
low by up to 56 registers. The margin is the cap's: the rule's largest
estimate is 112 (88 of fragments; at most 168 used under `__launch_bounds__(128)`) against 255. dlight's
wmma kernels (512 threads, cap 128) hold 112 of fragments: estimated 136,
over by 8; ptxas squeezed them into 102-128 registers and spilled in 5 of
124 (8 bytes in LLaMA's float16 backward on sm_80, 640-846 bytes in two
other products of LLaMA's backward on both archs).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.kernel_geometry import device_kernels

REGISTER_BYTES = 4
ADDRESS_REGISTERS = 24
WMMA_OPERAND_COPIES = 2  # a wmma operand fragment's elements per lane over its share of the tile
PER_LANE = ("warp", "wmma.accumulator")
WMMA_OPERANDS = ("wmma.matrix_a", "wmma.matrix_b")


@dataclass(frozen=True)
class KernelRegisters:
    """One kernel's estimate: its block's threads, registers per thread estimated and the cap."""

    kernel: str
    threads: int
    estimate: int
    cap: int

    @property
    def fits(self) -> bool:
        return self.estimate <= self.cap


def register_cap(threads: int, spec: TargetSpec) -> int:
    """Registers ptxas may give a thread of a block of `threads` under `__launch_bounds__(threads)`."""
    warps = -(-max(1, threads) // spec.warp_size)
    per_thread = spec.registers_per_sm // (warps * spec.warp_size)
    granule = max(1, spec.register_granule // spec.warp_size)
    cap = per_thread // granule * granule
    return min(cap, spec.max_registers_per_thread) if spec.max_registers_per_thread else cap


def _allocation_registers(buffer, warp: int) -> float:
    """32-bit registers per thread of one allocation (0 outside registers)."""
    scope = str(buffer.scope())
    dtype = tvm.DataType(str(buffer.dtype))
    elements = 1
    for extent in buffer.shape:
        elements *= int(extent)
    registers = elements * dtype.bits * dtype.lanes / (8 * REGISTER_BYTES)
    if scope == "local":
        return registers
    if scope in PER_LANE:
        return registers / warp
    if scope in WMMA_OPERANDS:
        return WMMA_OPERAND_COPIES * registers / warp
    return 0.0


def fragment_registers(kernel: tirx.PrimFunc, warp: int) -> int:
    """32-bit registers per thread of a lowered kernel's local, warp and wmma allocations."""
    total = []

    def visit(node):
        if type(node).__name__ == "AllocBuffer":
            total.append(_allocation_registers(node.buffer, warp))

    tvm_ffi.structural_walk(kernel.body, (object, visit), order="pre")
    return int(-(-sum(total) // 1))


def _threads(kernel: tirx.PrimFunc) -> int:
    extents = {}

    def visit(node):
        if type(node).__name__ == "AttrStmt" and node.attr_key == "thread_extent":
            name = str(node.node.var.name)
            if name.startswith("threadIdx") and isinstance(node.value, tirx.IntImm):
                extents[name] = int(node.value)

    tvm_ffi.structural_walk(kernel.body, (object, visit), order="pre")
    threads = 1
    for extent in extents.values():
        threads *= extent
    return threads


def kernel_registers(func: tirx.PrimFunc, spec: TargetSpec, name: str = "") -> list | None:
    """KernelRegisters of each kernel of a PrimFunc scheduled for CUDA; None where TVM's lowering fails."""
    try:
        kernels = device_kernels(func, Target({"kind": "cuda", "arch": spec.arch}), name)
    # TVM's lowering errors: tvm.error.InternalError (a RuntimeError), TypeError, ValueError
    except (RuntimeError, TypeError, ValueError):
        return None
    found = []
    for kernel_name, kernel in kernels:
        threads = _threads(kernel)
        estimate = fragment_registers(kernel, spec.warp_size) + ADDRESS_REGISTERS
        found.append(KernelRegisters(kernel_name, threads, estimate, register_cap(threads, spec)))
    return found


def over_cap(func: tirx.PrimFunc, spec: TargetSpec, name: str = "") -> KernelRegisters | None:
    """The first kernel of `func` whose estimate exceeds its cap (it would spill); None where all fit or
    the function does not lower."""
    kernels = kernel_registers(func, spec, name) or []
    return next((k for k in kernels if not k.fits), None)
