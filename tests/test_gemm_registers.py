"""Registers per thread of a GEMM's schedule against the cap of its block (pricing/gemm_registers.py), and the
timed GEMM choice leaving out a schedule over it: dlight's wmma Matmul (512 threads, capped at 128
registers, 112 of them fragments) spilled in LLaMA's float16 backward on sm_80. The tensor-core rule's
kernels under `__launch_bounds__(threads, 1)`: GPT-2's attention output projection spilled on sm_90
without the minimum."""

from __future__ import annotations

import dataclasses

import pytest
import tvm
from conftest import make_module, needs_nvcc, tensor
from test_gemm_choice import LARGE_SHALLOW, gemm
from tvm import relax

from schedules.cuda import tensor_core_matmul
from schedules.cuda.dlight_default import first_dlight_schedule
from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.gemm_choice import faster_gemm, on_tensor_cores
from tvm_stitch.pricing.gemm_registers import (
    ADDRESS_REGISTERS,
    kernel_registers,
    over_cap,
    register_cap,
)

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
SPEC = TargetSpec.from_target(TARGET)


def _dlight(func):
    with TARGET:
        sch, rule = first_dlight_schedule(func, TARGET)
    assert rule == "Matmul"
    return sch.mod["main"]


@pytest.mark.parametrize("threads,cap", [(512, 128), (384, 168), (256, 255), (128, 255), (1024, 64)])
def test_the_cap_is_the_sms_registers_over_the_block(threads, cap):
    assert register_cap(threads, SPEC) == cap


def test_a_spec_without_the_per_thread_limit_caps_by_the_sm_alone():
    assert register_cap(128, dataclasses.replace(SPEC, max_registers_per_thread=0)) == 512


def test_dlights_wmma_schedule_is_over_its_cap_and_the_rules_is_not():
    """512^3 float16: dlight's wmma kernel holds 4 accumulator fragments (32 registers), 4 of each operand
    (32 each, every element in two lanes) and two 16-element staging vectors (16): 112 of its 128."""
    func = gemm(512, 512, 512, "float16")
    theirs = _dlight(func)
    assert on_tensor_cores(theirs)
    (kernel,) = kernel_registers(theirs, SPEC)
    assert (kernel.threads, kernel.cap, kernel.estimate) == (512, 128, 112 + ADDRESS_REGISTERS)
    assert over_cap(theirs, SPEC) == kernel
    with TARGET:
        mine = tensor_core_matmul.apply(func, SPEC).mod["main"]
    (kernel,) = kernel_registers(mine, SPEC)
    assert kernel.threads == 128 and kernel.fits and over_cap(mine, SPEC) is None


def _choose(func, spec):
    with TARGET:
        return faster_gemm(func, tensor_core_matmul.apply(func, spec, tile=LARGE_SHALLOW), TARGET, spec, "gemm")


def test_a_faster_schedule_over_its_register_cap_is_not_taken():
    """sm_90: the large shallow tile is modeled slower than dlight's wmma Matmul, which is on tensor cores but
    over its register cap: the tensor-core rule stays, the line says why."""
    func = gemm(512, 512, 512, "float16")
    chosen, choice = _choose(func, SPEC)
    assert choice.rule == TENSOR_CORE_RULE and 0 < choice.default_us < choice.tensor_core_us
    assert choice.default_on_tensor_cores and choice.default_registers == (112 + ADDRESS_REGISTERS, 128)
    assert f"{112 + ADDRESS_REGISTERS} registers per thread estimated over its cap of 128: not a candidate" \
        in choice.line()
    assert str(chosen.attrs["tvm_stitch.schedule_rule"]) == TENSOR_CORE_RULE


@needs_nvcc
@pytest.mark.slow
def test_llama_float16_backward_gemms_carry_mma_without_spills_on_sm_80():
    """LLaMA's float16 backward at bench size on sm_80: dlight's wmma schedule of the product whose operand
    is RoPE's backward (modeled faster than the rule's, 128 registers under ptxas, 8 bytes spilled) is no
    candidate; every GEMM kernel carries mma and none spills."""
    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.gemm_ptx import gemm_kernels
    from tvm_stitch.tools.model_bench import import_step

    mod, _, _ = import_step("llama", "backward", "bench", "float16")
    built = build(mod, {"kind": "cuda", "arch": "sm_80"}, stitched=True)
    excluded = [c for c in built.report.gemms if c.default_registers]
    assert excluded and all(c.rule == TENSOR_CORE_RULE and c.default_us < c.tensor_core_us for c in excluded)
    kernels = gemm_kernels(built, "sm_80")
    assert len(kernels) >= 25
    assert [k for k in kernels if not k.mma or k.spill_bytes] == []


def _output_projection():
    """GPT-2's attention output projection at bench size in float16: the heads' outputs transposed and
    reshaped into the product with the weight, the bias (float32) and the residual added after it."""
    op = relax.op

    def body(bb, heads, weight, bias, x):
        rows = bb.emit(op.reshape(op.permute_dims(heads, [0, 2, 1, 3]), (512, 768)))
        product = bb.emit(op.add(op.matmul(rows, weight, out_dtype="float32"), bias))
        return bb.emit(op.add(x, op.reshape(op.astype(product, "float16"), (4, 128, 768))))

    return make_module([tensor("heads", (4, 12, 128, 64), "float16"), tensor("weight", (768, 768), "float16"),
                        tensor("bias", (768,), "float32"), tensor("x", (4, 128, 768), "float16")], body)


@needs_nvcc
def test_the_rules_kernel_keeps_one_block_per_sm_and_does_not_spill():
    """Under `__launch_bounds__(128)` alone ptxas for sm_90 spilled 8 bytes at 72 registers in this GEMM;
    with a minimum of one block per SM it does not (the rule's kernel, its mma in the PTX)."""
    from test_tensor_core_matmul import kernel_rules

    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.gemm_ptx import gemm_kernels
    from tvm_stitch.tools.launches import cuda_source

    built = build(_output_projection(), {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert TENSOR_CORE_RULE in kernel_rules(built).values()
    assert "__launch_bounds__(128, 1)" in cuda_source(built.executable)
    (kernel,) = gemm_kernels(built, "sm_90")
    assert kernel.rule == TENSOR_CORE_RULE and kernel.mma > 0 and kernel.spill_bytes == 0
