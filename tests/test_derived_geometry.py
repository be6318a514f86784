"""A plan's launch geometry derived from a lowered kernel of the same code equals the lowered geometry."""

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from schedules import schedule_for
from tvm_stitch.analysis.size_bounds import at_sizes
from tvm_stitch.stitch import kernel_maker
from tvm_stitch.pricing import derived_geometry, plan_prices
from tvm_stitch.pricing.derived_geometry import derivable, derived
from tvm_stitch.pricing.modeled_time import cuda_target, lowered_geometries
from tvm_stitch.pricing.plan_prices import PlanPrices
from tvm_stitch.pricing.timed_choice import choose_in_time
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.kernels import variants as variants_module
from tvm_stitch.kernels.variants import _restated
from tvm_stitch.planning.candidates import candidates
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.variants import sampled_plans, symbolic
from tvm_stitch.tools.build import build

from conftest import legalized, make_module, tensor

SPEC = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
N = tirx.Var("n", "int64")
OPS = {
    "softmax": lambda x: relax.op.nn.softmax(x, axis=-1),
    "log_softmax": lambda x: relax.op.nn.log_softmax(x, axis=-1),
    "layer_norm": lambda x: relax.op.nn.layer_norm(x, relax.const(np.ones(int(x.ty.shape[-1]), "float32")),
                                                   relax.const(np.zeros(int(x.ty.shape[-1]), "float32")), axes=[-1]),
}


def _func(op: str, length: int) -> tirx.PrimFunc:
    """The legalized PrimFunc of `op` over (n, length) rows, n symbolic."""
    mod = legalized(make_module([tensor("x", (N, length))], lambda bb, x: OPS[op](x)))
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return func


def _rule(func: tirx.PrimFunc, rows: int):
    return plan_kernel(at_sizes(func, {"n": rows}), SPEC, "k", rows_first=False)


def _lowered(scheduled: tirx.PrimFunc, plan) -> tuple:
    """(geometries, modeled traffic) of a PrimFunc scheduled by `plan`, static, lowered."""
    traffic = modeled_traffic(scheduled, SPEC).total
    return lowered_geometries(scheduled, SPEC, plan.registers, traffic, plan.kernel), traffic


def _scheduled(func: tirx.PrimFunc, plan, rows: int) -> tirx.PrimFunc:
    return schedule_for(at_sizes(func, {"n": rows}), plan, cuda_target(SPEC)).mod["main"]


@pytest.mark.parametrize("op, length, at, others", [
    ("softmax", 32, 4096, [8, 13, 1000, 1 << 20]),  # 8 rows per block
    ("layer_norm", 100, 512, [2, 3, 77]),  # 2 rows per block of 128 threads
    ("softmax", 30000, 64, [1, 7, 200]),  # row-split, two launches
], ids=["packed", "two-rows", "row-split"])
def test_a_plan_at_another_row_count_is_derived_as_lowered(op, length, at, others):
    func = _func(op, length)
    plan = _rule(func, at)
    reference, _ = _lowered(_scheduled(func, plan, at), plan)
    kernel = schedule_for(func, symbolic(plan, ("n",)), cuda_target(SPEC)).mod["main"]  # for every size
    for rows in others:
        assert derivable(plan, at, _restated(plan, _rule(func, rows)), rows)
        static, traffic = _lowered(_scheduled(func, _restated(plan, _rule(func, rows)), rows), plan)
        assert derived(list(reference), plan, at, plan, rows, traffic) == static
        if rows % plan.mapping.rows_per_task == 0:  # the kernel scheduled for every size, at `rows`
            assert derived(list(reference), plan, at, plan, rows, traffic) == _lowered(
                at_sizes(kernel, {"n": rows}), plan)[0]


@pytest.mark.parametrize("op, length, rows", [("softmax", 32, 4096), ("log_softmax", 64, 512)])
def test_other_rows_per_block_are_derived_as_lowered(op, length, rows):
    func = _func(op, length)
    static = at_sizes(func, {"n": rows})
    rule = plan_kernel(static, SPEC, "k", rows_first=False)
    reference, traffic = _lowered(_scheduled(func, rule, rows), rule)
    packed = [p for p in candidates(static, rule, SPEC)
              if p.mapping.rows_per_task not in (1, rule.mapping.rows_per_task)
              and dataclasses.replace(p.mapping, rows_per_task=1, grid=0)
              == dataclasses.replace(rule.mapping, rows_per_task=1, grid=0) and p.inlined() == rule.inlined()]
    assert len(packed) >= 2
    for plan in packed:
        assert derivable(rule, rows, plan, rows)
        lowered, moved = _lowered(_scheduled(func, plan, rows), plan)
        assert moved == traffic  # packing rows otherwise moves the same bytes
        assert derived(list(reference), rule, rows, plan, rows, traffic) == lowered


def test_fewer_rows_than_a_block_packs_and_one_row_per_block_are_not_derived():
    func = _func("softmax", 32)
    packed, alone = _rule(func, 4096), _rule(func, 64)
    assert packed.mapping.rows_per_task == 8 and alone.mapping.rows_per_task == 1
    assert not derivable(packed, 4096, packed, 5)  # 5 rows: a block of fewer than 8
    two = next(p for p in candidates(at_sizes(func, {"n": 64}), alone, SPEC) if p.mapping.rows_per_task == 2)
    assert not derivable(alone, 64, two, 64)
    # Refused for a reason: one row per block and two differ in more than the launch here.
    reference, _ = _lowered(_scheduled(func, alone, 64), alone)
    lowered, traffic = _lowered(_scheduled(func, two, 64), two)
    assert derived(list(reference), alone, 64, two, 64, traffic) != lowered


def test_a_timed_choice_lowers_only_the_plans_it_cannot_derive(monkeypatch):
    static = at_sizes(_func("softmax", 32), {"n": 1 << 20})
    rule = plan_kernel(static, SPEC, "k", rows_first=False)
    prices = PlanPrices(SPEC)
    chosen = choose_in_time(static, rule, SPEC, prices)
    # The rule plan (8 rows per block) and the exp recomputed, lowered; 2 and 4 rows per block derived.
    assert [p.mapping.rows_per_task for p in (x.plan for x in prices.lowered)] == [8, 8]
    monkeypatch.setattr(plan_prices, "derivable", lambda *_: False)
    lowered_all = PlanPrices(SPEC)
    assert choose_in_time(static, rule, SPEC, lowered_all) == chosen
    assert len(lowered_all.lowered) == 4
    assert derived_geometry.plan_grid(rule, 1 << 20) == (1 << 20) // 8


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("length", [32, 100, 128, 768, 30000])
def test_every_candidate_at_other_row_counts_is_derived_as_lowered(op, length):
    func = _func(op, length)
    for at in (64, 4096):
        static = at_sizes(func, {"n": at})
        rule = plan_kernel(static, SPEC, "k", rows_first=False)
        for plan in candidates(static, rule, SPEC):
            reference, _ = _lowered(_scheduled(func, plan, at), plan)
            for rows in (1, 5, 8, 96, 1000):
                restated = _restated(plan, _rule(func, rows))
                if not derivable(plan, at, restated, rows):
                    assert rows < plan.mapping.rows_per_task
                    continue
                lowered, traffic = _lowered(_scheduled(func, restated, rows), restated)
                assert derived(list(reference), plan, at, restated, rows, traffic) == lowered
            for other in candidates(static, rule, SPEC):
                if other is not plan and derivable(plan, at, other, at):
                    lowered, traffic = _lowered(_scheduled(func, other, at), other)
                    assert derived(list(reference), plan, at, other, at, traffic) == lowered


@pytest.mark.parametrize("length, upper, planned", [(32, 1 << 20, 4), (30000, 4096, 5)], ids=["packed", "row-split"])
def test_size_variants_are_those_chosen_with_every_sample_planned_and_every_plan_lowered(monkeypatch, length, upper,
                                                                                       planned):
    rule_plans = []
    rule = kernel_maker.plan_kernel
    monkeypatch.setattr(kernel_maker, "plan_kernel", lambda *args, **kw: rule_plans.append(args) or rule(*args, **kw))

    def variants():
        mod = make_module([tensor("x", (N, length))], lambda bb, x: relax.op.nn.softmax(x, axis=-1))
        mod["main"] = (mod["main"].with_attr("tir_var_lower_bound", {"n": 1})
                       .with_attr("tir_var_upper_bound", {"n": upper}))
        (group,) = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True).report.groups
        return [(condition, plan.to_json()) for condition, plan in group.variants]

    derived_too = variants()
    # (n, 32): no sample below 512 is planned (one row per block is modeled there at one launch and
    # one DRAM round trip, and the rules pack 2 rows per block at 512, 8 above it).
    assert len(rule_plans) == 1 + planned
    monkeypatch.setattr(plan_prices, "derivable", lambda *_: False)

    def every_sample(samples, statics, general, general_func, planner):
        return samples, sampled_plans(samples, lambda size: planner.rule(statics.at(size)))

    monkeypatch.setattr(variants_module, "_sampled", every_sample)
    assert variants() == derived_too and len(derived_too) == 2
