"""Row-split (global stitching across blocks) for few long rows on CUDA.

The CUDA schedule is built without thread bindings for llvm and checked
against numpy; the CUDA build is counted and compiled with nvcc.
"""

import re

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch import PhaseRole, StitchPlan, TargetSpec
from tvm_stitch.planning.row_split import MAX_CHOSEN_KERNELS, choose_split, plan_row_split
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.workloads import SUITE, reference
from tvm_stitch.tools.tune import fused_groups

from conftest import CUDA, LLVM, needs_nvcc, nvcc

LONG = {"rows": 16, "cols": 20000}  # 16 rows: far fewer than SMs; 80 KB rows: more than shared memory
SM90 = TargetSpec.from_target(CUDA)
SM80_TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
SM80 = TargetSpec.from_target(SM80_TARGET)


def _check_numerics(name: str, dims: dict, fast_math=None) -> list:
    graph = SUITE[name]
    inputs = graph.inputs(np.random.default_rng(1), "float32", dims)
    built = build(graph.build("float32", dims), LLVM, stitched=True, strict=True, emulate="cuda", fast_math=fast_math)
    outs = run_cpu(built.executable, inputs)
    for out, ref in zip(outs, reference(graph, [i.astype("float64") for i in inputs])):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    return built.report.plans


@pytest.mark.parametrize("name,kernels", [("softmax", 3), ("layernorm", 2), ("rmsnorm", 2)])
def test_long_rows_split_over_blocks_match_numpy(name, kernels):
    plans = _check_numerics(name, LONG)
    assert len(plans) == 1
    plan = plans[0]
    assert plan.scheme == "row-split" and plan.kernels == kernels
    assert plan.mapping.split == choose_split(16, 20000, SM90) > 1
    assert plan.mapping.grid == 16 * plan.mapping.split


def test_split_cuda_launches_and_plan_text():
    mod = SUITE["softmax"].build("float32", LONG)
    stitched = build(mod, CUDA, stitched=True, strict=True)
    default = build(mod, CUDA, stitched=False)
    assert count_launches(stitched.lowered, stitched.executable) == 2
    assert count_launches(default.lowered, default.executable) >= 3
    table = stitched.report.table()
    assert "row-split" in table and "blocks/row" in table
    assert "global stitching in 2 kernels" in stitched.report.details()
    assert "online softmax" in stitched.report.details()


@pytest.mark.parametrize("name", ["softmax", "cross_entropy"])
def test_online_softmax_partials_take_two_launches_and_match_numpy(name):
    """64 rows of 30000: each chunk's max and its sum of exp(x - that max) in one pass, the combine
    rescales the sums by exp(m_c - M): 2 launches instead of 3 (partial max; partial sum; normalise).
    The CPU check uses libm's exp, as CUDA does (fast math would hide the exp from the pattern)."""
    dims = {"rows": 64, "cols": 30000, "vocab": 30000}
    plans = _check_numerics(name, dims, fast_math=False)
    split = [p for p in plans if p.scheme == "row-split"]
    assert len(split) == 1 and split[0].kernels == 2 and len(split[0].online) == 1
    # The rules' chunks, or other chunks the time model prices lower (checked against numpy above).
    assert split[0].mapping.split == choose_split(64, 30000, SM90) or any(
        note.startswith("time model:") for note in split[0].notes)
    built = build(SUITE[name].build("float32", dims), CUDA, stitched=True, strict=True)
    (plan,) = [p for p in built.report.plans if p.scheme == "row-split"]
    assert plan.online == split[0].online
    assert count_launches(built.lowered, built.executable) == len(built.report.plans) + 1


def sum_of_exp_of_twice_x():
    """max(x), then exp(2x - max(x)) normalised by its sum, over 16 rows of 20000 (float32)."""
    x = relax.Var("x", relax.TensorType((16, 20000), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            op = relax.op
            mx = bb.emit(op.max(x, axis=[-1], keepdims=True))
            e = bb.emit(op.exp(op.subtract(op.add(x, x), mx)))
            out = bb.emit_output(op.divide(e, op.sum(e, axis=[-1], keepdims=True)))
        bb.emit_func_output(out)
    return bb.get()


def test_sum_of_exp_of_another_value_keeps_its_own_pass():
    """max(x) then sum(exp(2x - max)): the chunk max does not bound 2x, so the sum waits for the
    combined max (3 kernels) and still matches numpy."""
    data = np.random.default_rng(2).uniform(-1, 1, (16, 20000)).astype("float32")
    built = build(sum_of_exp_of_twice_x(), LLVM, stitched=True, strict=True, emulate="cuda", fast_math=False)
    (plan,) = built.report.plans
    assert plan.scheme == "row-split" and plan.kernels == 3 and plan.online == ()
    (out,) = run_cpu(built.executable, [data])
    e = np.exp(2 * data.astype("float64") - data.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=-1, keepdims=True), rtol=1e-4, atol=1e-6)


def test_long_chain_with_per_row_outputs_splits_in_two_kernels():
    """LayerNorm with mean and rstd outputs: their readers recompute them (no kernel waits for a
    per-row output) and the variance takes its partials in the mean's pass: 2 launches, 8 blocks
    per row, where the split once needed 5 and the group stayed one row-resident kernel."""
    (plan,) = _check_numerics("layernorm_stats", LONG)
    assert plan.scheme == "row-split" and plan.kernels == 2 and plan.mapping.split > 1
    assert plan.variance and plan.recomputed_outputs
    (fused, _), = fused_groups(SUITE["layernorm_stats"].build("float32", LONG), CUDA)
    assert plan_row_split(fused, SM90, "k", few_long_rows_only=True).kernels <= MAX_CHOSEN_KERNELS


def test_split_choice():
    assert choose_split(64, 30000, SM90) == 5  # 320 blocks for 2 x 132 SMs, chunks of 6000
    assert choose_split(64, 30000, SM80) == 4  # 256 blocks for 2 x 108 SMs
    assert choose_split(16, 20000, SM90) == 8  # as many as chunks of >= 2048 allow
    assert choose_split(64, 30011, SM90) == 1  # prime: no even chunks


def test_sm80_plans_few_long_rows_for_its_108_sms():
    """A 64x30000 softmax: split into chunks for two blocks per SM of the target's GPU."""
    mod = SUITE["softmax"].build("float32", {"rows": 64, "cols": 30000})
    plans = {}
    for arch in ("sm_80", "sm_90"):
        (plan,) = tvm_stitch.explain(mod, {"kind": "cuda", "arch": arch}, cost_model=False).plans
        assert plan.scheme == "row-split" and plan.spec.arch == arch
        plans[arch] = plan
    assert (plans["sm_80"].spec.sms, plans["sm_90"].spec.sms) == (108, 132)
    assert (plans["sm_80"].mapping.split, plans["sm_80"].mapping.grid) == (4, 256)
    assert (plans["sm_90"].mapping.split, plans["sm_90"].mapping.grid) == (5, 320)


def test_row_split_plan_round_trips_through_json_with_its_spec():
    (plan,) = tvm_stitch.explain(SUITE["softmax"].build("float32", LONG), SM80_TARGET).plans
    assert plan.scheme == "row-split" and plan.spec == SM80
    assert {p.role for p in plan.phases} == {PhaseRole.COMPUTE, PhaseRole.COMBINE}
    again = StitchPlan.from_json(plan.to_json())
    assert again == plan and isinstance(again.spec, TargetSpec) and again.phases == plan.phases
    assert again.phase_kernels(PhaseRole.COMBINE) == plan.phase_kernels(PhaseRole.COMBINE) != {}


@needs_nvcc
def test_online_softmax_float16_takes_two_launches_and_compiles(tmp_path):
    """float16: exp and its sum in float32 around float16 maxima; the combine rescales in float32.
    Numerics of this form: tests/test_simt.py (pocl runs the CUDA kernels)."""
    built = build(SUITE["softmax"].build("float16", {"rows": 64, "cols": 30000}), CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.scheme == "row-split" and plan.kernels == 2 and len(plan.online) == 1
    assert count_launches(built.lowered, built.executable) == 2
    nvcc(cuda_source(built.executable), tmp_path)


@needs_nvcc
def test_split_cuda_compiles_with_vector_accesses(tmp_path):
    mod = SUITE["softmax"].build("float32", {"rows": 64, "cols": 32768})
    built = build(mod, CUDA, stitched=True, strict=True)
    assert built.report.plans[0].mapping.vector == 4
    source = cuda_source(built.executable)
    assert "float4" in source
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(source, tmp_path))]
    assert spills and max(spills) == 0


def test_independent_column_sums_split_and_match_numpy():
    """Two independent column reductions (dgamma, dbeta) walking 16384 rows of 64 columns: two warps
    would walk them alone; split, their partials run in one kernel (with dx's rows: the mix-order plan,
    docs/column-reductions.md), the combines in the next."""
    plans = _check_numerics("layernorm_backward", {"rows": 16384, "cols": 64})
    (split,) = [p for p in plans if p.scheme == "mix-order"]
    assert split.mapping.split > 1 and split.kernels == 2
