"""A GEMM's schedule chosen in time (pricing/gemm_choice.py): the tensor-core rule's schedule and dlight's
default one of the same PrimFunc priced by the time model, the faster kept and recorded."""

from __future__ import annotations

import dataclasses

import pytest
import tvm
from tvm import te

from schedules.cuda import tensor_core_matmul
from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.pipeline import GuardedDefaultSchedule
from tvm_stitch.pricing.gemm_choice import RULE_ATTR, faster_gemm, on_tensor_cores
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
SPEC = TargetSpec.from_target(TARGET)
# The rule's tile before it was sized to the GEMM: 128 x 64 per block (32 blocks on 132 SMs), 16 deep
# per stage (32 stages of a round trip to memory each)
LARGE_SHALLOW = tensor_core_matmul.Tile((2, 2), (4, 2), 1)
# An SM with twice the registers: dlight's wmma kernel (512 threads, 112 registers of fragments) fits under
# its cap there (255, not 128; pricing/gemm_registers.py), so the time model alone decides
ROOMY = dataclasses.replace(SPEC, registers_per_sm=2 * SPEC.registers_per_sm)


def gemm(m: int, n: int, k: int, dtype: str = "bfloat16"):
    """The importer's product: float32 accumulation of `dtype` operands, cast back to `dtype`."""
    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((k, n), dtype, name="B")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                   name="C")
    return te.create_prim_func([a, b, te.compute((m, n), lambda i, j: c[i, j].astype(dtype), name="D")])


def _choose(func, tile=None, spec=SPEC):
    with TARGET:
        return faster_gemm(func, tensor_core_matmul.apply(func, spec, tile=tile), TARGET, spec, "gemm")


@pytest.mark.parametrize("tile,rule", [(None, TENSOR_CORE_RULE), (LARGE_SHALLOW, "Matmul")])
def test_the_faster_modeled_schedule_is_kept(tile, rule):
    """512^3 in float16: the rule's tile beats dlight's wmma Matmul in the model; a tile of 32 blocks and
    32 stages does not, and dlight's schedule (on tensor cores too, within its registers on ROOMY) is
    kept instead."""
    func, choice = _choose(gemm(512, 512, 512, "float16"), tile, ROOMY)
    assert choice.rule == rule and str(func.attrs[RULE_ATTR]) == rule
    assert choice.timed and choice.default_rule == "Matmul"
    kept, other = ((choice.tensor_core_us, choice.default_us) if rule == TENSOR_CORE_RULE
                   else (choice.default_us, choice.tensor_core_us))
    assert 0 < kept < other
    assert f"{rule}, modeled {kept:.1f} us" in choice.line()


def test_dlights_fma_schedule_is_not_taken_for_a_tensor_core_gemm():
    """bfloat16: dlight has no tensor-core path; its FMA Matmul, modeled faster than the large shallow
    tile, is still not taken: the GEMM stays on tensor cores (mma in its TIR), the line says why."""
    func, choice = _choose(gemm(512, 512, 512), LARGE_SHALLOW)
    assert choice.rule == TENSOR_CORE_RULE and 0 < choice.default_us < choice.tensor_core_us
    assert not choice.default_on_tensor_cores and on_tensor_cores(func)
    assert "on FMA units: not a candidate" in choice.line()


def test_the_pass_records_each_choice_in_the_report():
    report = StitchReport()
    mod = tvm.IRModule({"gemm": gemm(512, 512, 512).with_attr("global_symbol", "gemm")})
    with TARGET:
        out = GuardedDefaultSchedule(SPEC, report=report)(mod)
    (choice,) = report.gemms
    assert choice.kernel == "gemm" and str(out["gemm"].attrs[RULE_ATTR]) == choice.rule == TENSOR_CORE_RULE
    assert choice.line() in str(report)


def test_untimed_the_tensor_core_schedule_stays():
    report = StitchReport()
    mod = tvm.IRModule({"gemm": gemm(256, 256, 256).with_attr("global_symbol", "gemm")})
    with TARGET:
        out = GuardedDefaultSchedule(SPEC, timed=False, report=report)(mod)
    assert str(out["gemm"].attrs[RULE_ATTR]) == TENSOR_CORE_RULE and report.gemms == []


def test_the_module_comparison_names_the_schedule_kept():
    """`tvm-stitch explain`'s CUDA comparison lists each GEMM's choice after the stitched build's kernels."""
    from test_tensor_core_matmul import gemm_module
    from tvm_stitch.tools.module_time import comparison

    text = comparison(gemm_module("square", "bfloat16"), TARGET, SPEC, bounds=True)
    stitched, default = text.split("kernels of TVM's default build:")
    (line,) = [row for row in stitched.splitlines() if row.startswith("GEMM ")]
    assert "modeled" in line and "(time model)" in line and "GEMM " not in default
