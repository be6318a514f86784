"""Element-wise CUDA plans of several elements per thread (planning/candidates.py `_elements_per_thread`).

A thread per element launches many waves of threads that each wait one DRAM
round trip for one load; 2 or 4 elements per thread, a block's width apart
(each load coalesced, unrolled), keep that many loads in flight. The time
model chooses them (bias_gelu, Adam's larger tensors). Checked like the other
plans: llvm numerics of the CUDA schedule, SIMT on pocl and Oclgrind, nvcc
for sm_80 and sm_90 with no spills.
"""

import re

import numpy as np
import pytest
import tvm

import tvm_stitch
from schedules import schedule_for
from tvm_stitch import simt
from tvm_stitch.planning.candidates import ELEMENTS_PER_THREAD, candidates
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.idle_guard import bandwidth_share
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.tune import fused_groups
from tvm_stitch.tools.workloads import SUITE, dims

from conftest import CUDA, LLVM, needs_nvcc, nvcc, opencl_device


def _bias_gelu(rows: int, cols: int):
    return SUITE["bias_gelu"].build("float32", dict(dims("bench"), rows=rows, cols=cols))


def _bench(name: str):
    return SUITE[name].build("float32", dims("bench"))


def test_an_element_wise_rule_plan_gets_variants_of_more_elements_per_thread():
    spec = TargetSpec.from_target(CUDA)
    ((fused, rule),) = fused_groups(_bias_gelu(16, 1024), CUDA)
    assert rule.mapping.threads == 1 and rule.mapping.row_elements == 1 and rule.mapping.vector == 1
    wider = [p for p in candidates(fused, rule, spec) if p.mapping.vector > 1 and p.mapping.threads == 1]
    assert sorted(p.mapping.vector for p in wider) == sorted(ELEMENTS_PER_THREAD)
    for plan in wider:
        assert plan.mapping.grid * plan.mapping.rows_per_task * plan.mapping.vector == rule.mapping.rows


@pytest.mark.parametrize("name", ["bias_gelu", "adam_update"])
def test_more_elements_per_thread_are_chosen_by_modeled_time(name):
    """bias_gelu at bench size: one launch of 4096x768, at half the peak or more; the rule plan (a thread
    per element, 11 waves of one load each) was modeled at 46%."""
    report = tvm_stitch.explain(_bench(name), CUDA)
    wider = [p for p in report.plans if p.mapping.vector > 1 and p.mapping.threads == 1]
    assert wider
    for plan in wider:
        (note,) = [n for n in plan.notes if n.startswith("time model:")]
        assert plan.modeled_us < float(re.search(r"against the rules' ([0-9.]+) us", note).group(1))
        assert f"{plan.mapping.vector} elem/thr" in report.table()
    if name == "bias_gelu":
        assert bandwidth_share(report.plans[0]) >= 0.5


@pytest.mark.parametrize("lanes", ELEMENTS_PER_THREAD)
def test_more_elements_per_thread_match_numpy(lanes):
    """The CUDA schedule of each variant built without thread bindings for llvm (the llvm pipeline's own
    plans differ: its fast erf changes the kernel the time model prices)."""
    graph = SUITE["bias_gelu"]
    d = dict(dims("bench"), rows=64, cols=1024)
    spec = TargetSpec.from_target(CUDA)
    ((fused, rule),) = fused_groups(graph.build("float32", d), CUDA)
    (plan,) = [p for p in candidates(fused, rule, spec) if p.mapping.vector == lanes and p.mapping.threads == 1]
    emulated = schedule_for(fused, plan, LLVM).mod["main"].with_attr("global_symbol", "main")
    lib = tvm.tirx.build(tvm.IRModule({"main": emulated}), target=LLVM)
    x, b = graph.inputs(np.random.default_rng(2), "float32", d)
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(b), out)
    expected = graph.reference(x.astype("float64"), b.astype("float64"))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_adam_packed_with_more_elements_per_thread_matches_numpy():
    graph = SUITE["adam_update"]
    d = dims("bench")
    inputs = graph.inputs(np.random.default_rng(4), "float32", d)
    built = build(graph.build("float32", d), LLVM, stitched=True, strict=True, emulate="cuda")
    assert any(p.mapping.vector > 1 and p.mapping.threads == 1 for p in built.report.plans)
    outs = run_cpu(built.executable, inputs)
    expected = graph.reference(*[a.astype("float64") for a in inputs])
    for out, ref in zip(outs, expected if isinstance(expected, tuple) else (expected,)):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_more_elements_per_thread_run_on_pocl_with_simt_semantics():
    opencl_device(False)
    report = simt.check(_bias_gelu(512, 1024))
    assert report.stitch.plans[0].mapping.vector > 1
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)


def test_adam_packed_with_more_elements_per_thread_runs_on_pocl():
    """Adam's twelve kernels in one packed launch, members of 1, 2 and 4 elements per thread."""
    opencl_device(False)
    report = simt.check(_bench("adam_update"))
    assert {p.mapping.vector for p in report.stitch.plans} >= {1, 2, 4}
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)


def test_more_elements_per_thread_are_clean_under_oclgrind():
    device = opencl_device(True)
    spec = TargetSpec.from_target(CUDA)
    ((fused, rule),) = fused_groups(_bias_gelu(16, 1024), CUDA)
    (plan,) = [p for p in candidates(fused, rule, spec) if p.mapping.vector == max(ELEMENTS_PER_THREAD)]
    scheduled = schedule_for(fused, plan, CUDA).mod["main"]
    check = check_kernel("bias_gelu", scheduled, [Reference(fused, tuple(range(len(fused.params))))], device,
                         True, 0)
    assert check.status == "ok", str(check)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name, launches", [("bias_gelu", 1), ("adam_update", 1)])
def test_more_elements_per_thread_compile_without_spills(name, launches, arch, tmp_path):
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    built = build(_bench(name), target, stitched=True, strict=True)
    assert any(p.mapping.vector > 1 for p in built.report.plans) or (name, arch) == ("adam_update", "sm_80")
    assert count_launches(built.lowered, built.executable) == launches
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(cuda_source(built.executable), tmp_path,
                                                                           arch=arch))]
    assert spills and max(spills) == 0
