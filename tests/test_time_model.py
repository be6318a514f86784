"""The CUDA time model on known facts, the geometry read from scheduled kernels, and choices made in time."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import tvm

from conftest import CUDA, LLVM
from tvm_stitch import StitchFusion
from tvm_stitch.pricing.kernel_geometry import kernel_geometries
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.planning import time_fit
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec, time_constants, _arch_facts
from tvm_stitch.kernels.timed_packing import pack_in_time
from tvm_stitch.planning.time_model import (KernelGeometry, geometry_from_dict, kernel_time, peak_bytes_per_us,
                                            resident_blocks)
from tvm_stitch.report import StitchReport
from tvm_stitch.tools.build import build
from tvm_stitch.tools.workloads import SUITE, dims
from tvm_stitch.tools.workloads.attention import Chain

H200 = TargetSpec.from_target(CUDA)
A100 = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
BYTES = 1 << 28  # 256 MiB copied: read once, written once


def copy(threads: int, grid: int, width: int = 16) -> KernelGeometry:
    """A copy of BYTES: `grid` blocks of `threads` threads, each moving its share in `width`-byte accesses."""
    per_thread = BYTES // (threads * grid * width)
    return KernelGeometry("copy", grid, threads, loads=((width, per_thread),), stores=((width, per_thread),),
                          load_sites=min(per_thread, 4), load_phases=1, serial_iterations=per_thread if per_thread > 1 else 0)


@pytest.mark.parametrize("spec", [H200, A100], ids=["sm_90", "sm_80"])
def test_a_copy_with_many_threads_reaches_the_achievable_bandwidth(spec):
    time = kernel_time(copy(256, BYTES // (256 * 16)), spec)
    assert time.bound == "bandwidth"
    assert 0.85 <= time.bandwidth_fraction <= 0.9  # the achievable share, less launch and tail
    assert time.bytes == 2 * BYTES


def test_published_bandwidths_per_arch():
    assert peak_bytes_per_us(H200) == pytest.approx(4.8e6)  # the H200 is the sm_90 entry
    assert peak_bytes_per_us(A100) == pytest.approx(2.039e6)


def test_the_same_bytes_with_1024_threads_are_far_below_the_peak():
    few = kernel_time(copy(256, 4), H200)  # 128-bit loads and stores, four loads in flight per thread
    assert few.bound == "latency" and few.bandwidth_fraction < 0.05
    assert few.us > 20 * kernel_time(copy(256, BYTES // (256 * 16)), H200).us


def test_a_column_sum_over_1024_threads_reaches_under_one_percent():
    # A 4096 x 1024 float32 sum over the rows, a thread per column walking its 4096 rows serially.
    column_sum = KernelGeometry("column_sum", 32, 32, loads=((4, 4096),), stores=((4, 1),), load_sites=4,
                                load_phases=1, serial_iterations=4096)
    time = kernel_time(column_sum, H200)
    assert time.bound == "latency" and time.bandwidth_fraction < 0.01
    assert time.bytes == 4096 * 1024 * 4 + 1024 * 4


def test_waves_and_the_tail_wave():
    geometry = KernelGeometry("g", 1, 256, loads=((16, 1),), stores=((16, 1),), load_sites=1, load_phases=1)
    per_wave, share = resident_blocks(geometry, H200)
    assert per_wave == 8 * H200.sms and share == 1.0  # 2048 threads per SM: 8 blocks of 256
    full = kernel_time(dataclasses.replace(geometry, grid=2 * per_wave), H200)
    assert (full.waves, full.tail) == (2, 0.0)
    tail = kernel_time(dataclasses.replace(geometry, grid=2 * per_wave + per_wave // 2), H200)
    assert (tail.waves, tail.tail) == (2, 0.5)
    one_more = kernel_time(dataclasses.replace(geometry, grid=2 * per_wave + 1), H200)
    assert one_more.us - full.us >= H200.dram_latency_us  # one block more costs a whole round trip


def test_occupancy_limits_the_resident_blocks():
    geometry = KernelGeometry("g", 10000, 256, loads=((4, 4),), load_sites=4, load_phases=1)
    big_shared = dataclasses.replace(geometry, shared_bytes=100 << 10)  # two blocks per SM
    assert resident_blocks(big_shared, H200)[0] == 2 * H200.sms
    assert kernel_time(big_shared, H200).us > 2 * kernel_time(geometry, H200).us


def test_a_tiny_kernel_costs_about_its_launch():
    time = kernel_time(KernelGeometry("tiny", 1, 32, loads=((4, 1),), stores=((4, 1),), load_sites=1,
                                      load_phases=1), H200)
    assert time.bound == "launch"
    assert H200.launch_us <= time.us <= H200.launch_us + 1.0


def test_special_functions_make_a_kernel_slower():
    plain = copy(256, BYTES // (256 * 16))
    heavy = dataclasses.replace(plain, sfu_ops=64.0)
    assert kernel_time(heavy, H200).bound == "sfu"
    assert kernel_time(heavy, H200).us > 1.5 * kernel_time(plain, H200).us


def test_bad_geometry_and_a_cpu_spec_are_refused():
    with pytest.raises(ValueError, match="grid"):
        kernel_time(KernelGeometry("g", 0, 32), H200)
    with pytest.raises(ValueError, match="CUDA spec"):
        kernel_time(copy(256, 4), TargetSpec.from_target(LLVM))


def _stitched(mod, target=CUDA, **kwargs):
    report = StitchReport()
    with target:
        out = tvm.transform.Sequential(_grouping(target) + [StitchFusion(target, report=report, **kwargs)])(mod)
    return out, report


def _grouping(target):
    from tvm_stitch.pipeline import grouping_passes

    return grouping_passes(target)


def _kernel(out, plan):
    return next(f for gv, f in out.functions_items() if gv.name_hint == plan.kernel)


def test_geometry_of_a_scheduled_softmax_matches_its_plan():
    out, report = _stitched(SUITE["softmax"].build("float32", {"rows": 256, "cols": 768}), cost_model=False)
    (plan,) = report.plans
    (geometry,) = kernel_geometries(_kernel(out, plan), CUDA, plan.registers, plan.modeled_bytes)
    m = plan.mapping
    assert (geometry.grid, geometry.threads) == (m.grid, plan.threads_per_block)
    assert m.vector == 4 and dict(geometry.loads) == {16: 1}  # the row is loaded once, 128 bits per thread
    assert dict(geometry.stores) == {16: 1}
    assert geometry.sfu_ops == 768 // geometry.threads  # one exp per element, the row over the threads
    assert geometry.barriers >= 4  # two block-wide reductions, each staged through shared memory
    assert geometry.shared_bytes >= 768 * 4  # the cached row
    assert geometry.dram_bytes == plan.modeled_bytes == 2 * 256 * 768 * 4


def test_every_cuda_plan_records_its_modeled_time():
    _, report = _stitched(SUITE["layernorm_softmax"].build("float32", dims("test")))
    assert report.plans and all(p.modeled_us > 0 for p in report.plans)
    assert "us (" in report.table()


def test_a_plan_without_a_modeled_time_still_loads_from_json():
    _, report = _stitched(SUITE["softmax"].build("float32", dims("test")))
    plan = report.plans[0]
    assert StitchPlan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    del data["modeled_us"]
    for key in ("hbm_bytes_per_us", "dram_latency_us", "launch_us", "sfu_per_sm_us", "clock_ghz"):
        del data["spec"][key]
    old = StitchPlan.from_json(json.dumps(data))
    assert old.modeled_us == -1.0 and old.spec.hbm_bytes_per_us == 0.0


def test_tvm_default_kernels_are_priced_by_the_same_model():
    from tvm_stitch.target import default_pipeline

    mod = SUITE["softmax"].build("float32", {"rows": 256, "cols": 768})
    with CUDA:
        lowered = default_pipeline(CUDA)(mod)
    priced = [t for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
              for t in (modeled_times(f, H200, name=gv.name_hint) or [])]
    assert len(priced) >= 3  # TVM's default: a kernel per reduction and per element-wise step
    assert all(t.us > H200.launch_us and t.launched_threads > 0 for t in priced)


BENCH_SOFTMAX = {"rows": 4096, "cols": 768}


def test_choices_in_time_are_never_slower_than_the_rules_and_launch_as_often():
    mod = SUITE["softmax"].build("float32", BENCH_SOFTMAX)
    _, rules = _stitched(mod, cost_model=False)
    _, chosen = _stitched(mod)
    assert [p.kernels for p in chosen.plans] == [p.kernels for p in rules.plans]
    for rule, plan in zip(rules.plans, chosen.plans):
        assert 0 < plan.modeled_us <= rule.modeled_us
    assert any(plan.modeled_us < rule.modeled_us for rule, plan in zip(rules.plans, chosen.plans))
    assert any("time model: candidate" in note for p in chosen.plans for note in p.notes)


def test_a_choice_in_time_computes_the_same_values_emulated(rng):
    from tvm_stitch.tools.build import run_cpu

    mod = SUITE["softmax"].build("float32", BENCH_SOFTMAX)
    built = build(mod, LLVM, stitched=True, emulate="cuda")
    assert any("time model: candidate" in note for p in built.report.plans for note in p.notes)
    x = rng.standard_normal((4096, 768)).astype("float32")
    (out,) = run_cpu(built.executable, [x])
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_fitted_constants_override_the_published_ones(tmp_path):
    (tmp_path / "sm_90.json").write_text(json.dumps({"arch": "sm_90", "constants": {
        "dram_latency_us": 0.9, "launch_us": 2.5, "bogus": 1.0}}))
    fitted = time_fit.load_fit("sm_90", tmp_path)
    assert fitted == {"dram_latency_us": 0.9, "launch_us": 2.5}
    assert time_fit.load_fit("sm_80", tmp_path) == {}
    (tmp_path / "sm_80.json").write_text("not json")
    assert time_fit.load_fit("sm_80", tmp_path) == {}
    published = time_constants("sm_90", _arch_facts(90))
    assert published["hbm_bytes_per_us"] == pytest.approx(0.9 * 4.8e6) and published["dram_latency_us"] == 0.7
    constants = time_constants("sm_90", _arch_facts(90), fitted)
    assert (constants["dram_latency_us"], constants["launch_us"]) == (0.9, 2.5)
    assert constants["hbm_bytes_per_us"] == published["hbm_bytes_per_us"]


def test_special_functions_are_counted_per_element():
    out, report = _stitched(SUITE["bias_gelu"].build("float32", dims("test")), cost_model=False)
    (plan,) = report.plans
    (geometry,) = kernel_geometries(_kernel(out, plan), CUDA, plan.registers)
    elements = sum(count for _, count in geometry.stores)  # an output per element
    assert geometry.sfu_ops == 2 * elements > 0  # gelu's erf: two special-function results each


def test_a_packed_launch_counts_one_members_work_per_thread():
    """Adam's per-parameter kernels share a launch: an if-else chain over the block index, of
    which a thread runs one branch: one member's loads, stores and sqrt, not the sum of all."""
    out, report = _stitched(SUITE["adam_update"].build("float32", dims("test")), cost_model=False)
    (packed, members), = report.packs
    (whole,) = kernel_geometries(next(f for gv, f in out.functions_items() if gv.name_hint == packed), CUDA)
    plans = {p.kernel: p for p in report.plans}
    assert len(members) > 2 and whole.grid == sum(plans[m].mapping.grid for m in members)
    assert whole.stores == ((4, 3),)  # the parameter and both moments, one element per thread
    assert whole.sfu_ops == 1.0  # the square root of the second moment
    # each member on its own range of blocks: its grid, its work per thread
    assert [m.grid for m in whole.members] == [plans[m].mapping.grid for m in members]
    assert all(m.stores == ((4, 3),) and m.threads == whole.threads for m in whole.members)


def test_a_causal_attention_is_priced_at_its_mean_key_range():
    """The causal kernel's key loop runs to the diagonal (an extent of the block index): priced
    at its mean over the launch, below the full-range kernel of the same shape (one where the fused
    kernel is modeled faster than TVM's default path, so the chain fuses)."""
    def modeled(mask):
        built = build(Chain(8, 12, 128, 128, 64, mask=mask).module(), CUDA, stitched=True)
        times = modeled_times(built.lowered["fused_attention"], TargetSpec.from_target(tvm.target.Target(CUDA)))
        assert times is not None and len(times) == 1
        return times[0]

    causal, full = modeled("causal"), modeled(None)
    assert causal.launched_threads == full.launched_threads
    assert 0.3 * full.us < causal.us < full.us


def test_a_packed_launch_is_priced_as_its_members_one_after_the_other():
    """A big copy packed with a small one costs one launch overhead less than both apart, not
    the small one's work on the big one's blocks (nor the big one's on the small one's)."""
    big, small = copy(256, BYTES // (256 * 16)), copy(256, 64, width=4)
    packed = dataclasses.replace(big, grid=big.grid + small.grid, members=(big, small))
    apart = [kernel_time(g, H200) for g in (big, small)]
    together = kernel_time(packed, H200)
    assert together.us == pytest.approx(sum(t.us for t in apart) - H200.launch_us)
    assert together.launched_threads == big.grid * 256 + small.grid * 256
    assert geometry_from_dict(dataclasses.asdict(packed)) == packed


def test_a_pack_slower_than_its_members_apart_is_refused():
    out, report = _stitched(SUITE["adam_update"].build("float32", dims("test")), cost_model=False)
    (packed, members), = report.packs
    func = next(f for gv, f in out.functions_items() if gv.name_hint == packed)
    plans = [next(p for p in report.plans if p.kernel == m) for m in members]
    assert all(p.modeled_us > 0 for p in plans) and pack_in_time(func, plans, H200)
    cheap = [dataclasses.replace(p, modeled_us=0.1) for p in plans]  # members apart priced below a launch
    assert not pack_in_time(func, cheap, H200)
