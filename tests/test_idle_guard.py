"""The idle guard: every stitched CUDA kernel that moves 4 MB or more and is modeled under 50% of the
peak bandwidth carries a reason code saying why no fuller plan exists (pricing/idle_guard.py)."""

import dataclasses

import pytest
import tvm

import tvm_stitch
from tvm_stitch.planning.plan import StitchPlan, ThreadMapping
from tvm_stitch.planning.reasons import Reason
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import KernelGeometry, kernel_time, resident_blocks
from tvm_stitch.pricing.idle_guard import IDLE_BYTES, IDLE_SHARE, bandwidth_share, idle_reason, is_idle
from tvm_stitch.tools.idle_graphs import GRAPHS
from tvm_stitch.tools.workloads import SUITE, dims

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _unexplained(report) -> list:
    return [(p.kernel, p.modeled_bytes, round(bandwidth_share(p), 3)) for p in report.plans
            if is_idle(p) and p.idle is None]


@pytest.mark.parametrize("name", sorted(SUITE))
def test_no_suite_kernel_is_idle_without_a_reason(name):
    graph = SUITE[name]
    report = tvm_stitch.explain(graph.build(graph.dtypes[0], dims("bench")), SM90)
    assert report.plans
    assert _unexplained(report) == []


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_no_kernel_of_an_under_filling_graph_is_idle_without_a_reason(name):
    report = tvm_stitch.explain(GRAPHS[name](), SM90)
    assert report.plans
    assert _unexplained(report) == []
    for plan in report.plans:
        if plan.idle is not None:
            assert is_idle(plan)
            assert f"idle {plan.kernel} [{plan.idle.code}]: {plan.idle.text}" in report.table()
            assert f"idle [{plan.idle.code}]" in report.details()


def test_a_group_norm_through_a_reshape_is_split_over_its_groups_and_says_why_it_stays_idle():
    """The groups (batch x group: 64 rows of 16384) come through a reshape: split over 512 blocks, still
    under one wave of resident blocks; the reason names the rows, the blocks and the split (its two
    launches of 8.4 MB are capped under the share too: the under-filled grid is checked first)."""
    report = tvm_stitch.explain(GRAPHS["group_norm_8x32x64x64_g8"](), SM90)
    (plan,) = report.plans
    assert plan.scheme == "row-split" and plan.reshaped
    assert plan.modeled_bytes >= IDLE_BYTES and bandwidth_share(plan) < IDLE_SHARE
    assert plan.idle.code == "idle-few-rows"
    params = plan.idle.params
    assert (params["rows"], params["length"]) == (64, 8 * 32 * 64 * 64 // 64)
    assert params["blocks"] == 64 * plan.mapping.split
    assert params["threads"] == params["blocks"] * plan.threads_per_block < params["resident"]
    assert params["candidates"] >= 1
    assert f"split {plan.mapping.split} chunks per row already" in params["split"]


def test_a_plan_keeps_its_idle_reason_through_json():
    report = tvm_stitch.explain(GRAPHS["group_norm_8x32x64x64_g8"](), SM90)
    plan = report.plans[0]
    again = StitchPlan.from_json(plan.to_json())
    assert again.idle == plan.idle and again.idle.text == plan.idle.text


def _plan(modeled_bytes: int, modeled_us: float) -> StitchPlan:
    spec = TargetSpec.from_target(SM90)
    return StitchPlan("k", "cuda", "row-resident", ("b",), ("b",), 1, (100000,),
                      ThreadMapping(100000, 1, 256, 1, 100000), modeled_bytes=modeled_bytes,
                      modeled_us=modeled_us, spec=spec)


def test_a_kernel_idle_for_no_known_cause_gets_no_reason():
    """Many blocks (waves of them), a serial loop the time model prices far above the bytes: the guard
    finds neither an under-filled grid nor a launch-bound kernel, so the plan stays unexplained."""
    spec = TargetSpec.from_target(SM90)
    geometry = KernelGeometry("k", 100000, 256, loads=((4, 1),), stores=((4, 1),), load_sites=1, load_phases=1,
                              serial_iterations=100000, dram_bytes=IDLE_BYTES * 25)
    time = kernel_time(geometry, spec)
    plan = _plan(IDLE_BYTES * 25, time.us)
    assert is_idle(plan)
    assert idle_reason(plan, None, spec, [time]) is None


def test_a_small_or_busy_kernel_is_not_guarded():
    spec = TargetSpec.from_target(SM90)
    fast_us = IDLE_BYTES * 2 / (spec.hbm_bytes_per_us * 0.9)
    assert not is_idle(_plan(IDLE_BYTES - 1, 1000.0))
    assert not is_idle(_plan(IDLE_BYTES * 2, fast_us))
    assert is_idle(_plan(IDLE_BYTES * 2, fast_us * 10))


def test_a_launch_bound_kernel_says_so():
    spec = TargetSpec.from_target(SM90)
    one = KernelGeometry("k", 1, 256, loads=((16, 1),), stores=((16, 1),), load_sites=1, load_phases=1)
    wave, _ = resident_blocks(one, spec)  # one full wave: the grid is not under-filled
    geometry = dataclasses.replace(one, grid=wave)
    time = kernel_time(geometry, spec)
    assert geometry.memory_bytes >= IDLE_BYTES and time.launch_us * 2 >= time.us
    reason = idle_reason(_plan(geometry.memory_bytes, time.us), None, spec, [time])
    assert isinstance(reason, Reason) and reason.code == "idle-launch-bound"
    assert reason.params["launch_us"] == round(spec.launch_us, 2)


def test_a_kernel_whose_launch_caps_it_under_the_share_says_so():
    """attention_softmax's one kernel of 12.6 MB: 3 us of launch and 2.9 us of bytes at the achievable
    bandwidth leave any one-launch plan at 44% of the peak or less, under the guard's 50%."""
    graph = SUITE["attention_softmax"]
    (plan,) = tvm_stitch.explain(graph.build("float32", dims("bench")), SM90).plans
    assert is_idle(plan) and plan.idle.code == "idle-launch-cap"
    params = plan.idle.params
    assert params["launches"] == 1 and bandwidth_share(plan) <= params["cap"] < IDLE_SHARE


def test_a_latency_bound_kernel_chosen_among_its_candidates_says_so():
    graph = SUITE["layernorm_softmax"]
    (plan,) = tvm_stitch.explain(graph.build("float32", dims("bench")), SM90).plans
    assert is_idle(plan) and plan.idle.code == "idle-latency-bound"
    params = plan.idle.params
    assert params["latency_us"] > params["bandwidth_us"] and params["phases"] >= 2 and params["candidates"] > 1

