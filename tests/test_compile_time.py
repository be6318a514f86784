"""Compile time linear in the graph: a chain of K LayerNorms schedules work linear in K.

Counted, not timed: the TIR blocks of every plan the stitch pass schedules
(the kernels built and the plans priced). Identical kernels of a
chain cut into groups of a few LayerNorms (planning/limits.py: GROUP_REDUCTIONS)
are planned and priced once, so the count does not grow with K at all, where
one kernel of the whole chain made it grow as K times its candidate plans. The
fusion search's enumeration is counted too (its convexity checks).
"""

from __future__ import annotations

import dataclasses

import pytest
import tvm
from tvm import relax, tirx
import tvm_stitch
from tvm_stitch.grouping import candidate_groups, group_pricing
from tvm_stitch.grouping.fusion_search import OUT_OF_TIME, OVER_BUDGET
from tvm_stitch.planning.candidates import candidates
from tvm_stitch.planning.limits import GROUP_REDUCTIONS
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing import modeled_time, plan_prices
from tvm_stitch.pricing.plan_prices import PlanPrices
from tvm_stitch.pricing.price_memo import PriceMemo
from tvm_stitch.stitch import kernel_maker, module_pass
from tvm_stitch.tools.workloads import relax_blocks as rx

from conftest import legalized, make_module, tensor

CUDA = {"kind": "cuda", "arch": "sm_90"}
LLVM = {"kind": "llvm", "mcpu": "znver3"}
PER_GROUP = GROUP_REDUCTIONS // 2  # LayerNorms per kernel (two reductions each)


def chain(k: int):
    """K LayerNorms of a 64 x 256 input, each reading the one before."""
    def body(bb, x, g, b):
        for _ in range(k):
            x = rx.layernorm(bb, x, g, b, "float32")[0]
        return x
    return rx.function(rx.row_params("float32", {"rows": 64, "cols": 256}, "gamma", "beta"), body)


def scheduled_blocks(monkeypatch, k: int, target, fusion: str) -> tuple:
    """(TIR blocks handed to schedules while `explain` compiles a chain of k LayerNorms, its kernels)."""
    counted = []
    for module in (kernel_maker, plan_prices, modeled_time, group_pricing):
        real = module.schedule_for

        def counting(func, plan, tgt, real=real):
            counted.append(len(plan.ops))
            return real(func, plan, tgt)
        monkeypatch.setattr(module, "schedule_for", counting)
    report = tvm_stitch.explain(chain(k), target, fusion=fusion)
    monkeypatch.undo()
    assert not report.fallbacks
    return sum(counted), len(report.plans)


@pytest.mark.parametrize("target, fusion", [(CUDA, "greedy"), (LLVM, "greedy"), (CUDA, "search"), (LLVM, "search")],
                         ids=["cuda-greedy", "llvm-greedy", "cuda-search", "llvm-search"])
def test_chain_schedules_the_same_work_at_every_length(monkeypatch, target, fusion):
    short = scheduled_blocks(monkeypatch, PER_GROUP, target, fusion)
    long = scheduled_blocks(monkeypatch, 3 * PER_GROUP, target, fusion)
    assert 0 < short[0] == long[0]
    assert (short[1], long[1]) == (1, 3)


def test_function_over_its_budget_is_not_searched_and_says_so(monkeypatch):
    monkeypatch.setattr(module_pass, "FUNCTION_SECONDS", 0.0)
    report = tvm_stitch.explain(chain(2 * PER_GROUP), CUDA, fusion="search")
    assert [(r.method, r.why) for r in report.searches] == [("greedy", OVER_BUDGET)]
    assert len(report.plans) == 2 and any("compile-time budget" in note for note in report.notes)
    assert "compile-time budget is spent" in str(report)


def test_search_time_limit_counts_its_pricing(monkeypatch):
    """A limit already spent by greedy's pricing leaves the solver no time (it had a tenth of a second)."""
    monkeypatch.setattr(module_pass, "SEARCH_SECONDS", 0.0)
    report = tvm_stitch.explain(chain(2 * PER_GROUP), CUDA, fusion="search")
    assert [(r.method, r.why) for r in report.searches] == [("greedy", OUT_OF_TIME)]
    assert len(report.plans) == 2


def _softmax(rows: int) -> tirx.PrimFunc:
    mod = legalized(make_module([tensor("x", (rows, 256))], lambda bb, x: relax.op.nn.softmax(x, axis=-1)))
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return func


def test_price_memo_prices_a_kernel_and_plan_once_per_module():
    spec = TargetSpec.from_target(tvm.target.Target(CUDA))
    func, same = _softmax(64), _softmax(64)
    rule = plan_kernel(func, spec, "stitch_0")
    memo = PriceMemo()
    first = PlanPrices(spec, memo).plan_times(func, rule)
    # another group's kernel of the same code, its plan under another name: found, not priced
    assert PlanPrices(spec, memo).plan_times(same, dataclasses.replace(rule, kernel="stitch_1")) == first
    assert memo.priced == 1 and first
    other = next(p for p in candidates(func, rule, spec) if p.mapping.threads != rule.mapping.threads)
    PlanPrices(spec, memo).plan_times(func, other)
    PlanPrices(spec, memo).plan_times(_softmax(128), rule)
    assert memo.priced == 3


def test_search_checks_candidates_in_number_linear_in_length(monkeypatch):
    """The search's enumeration of a chain whose LayerNorms all read one gamma and beta: twice the
    length, about twice the convexity checks (every reader a neighbour of every other made it 3.3x)."""
    checks = [0]
    real = candidate_groups.convex

    def counting(*args):
        checks[0] += 1
        return real(*args)
    monkeypatch.setattr(candidate_groups, "convex", counting)
    counts = []
    for k in (2 * PER_GROUP, 4 * PER_GROUP):
        checks[0] = 0
        tvm_stitch.explain(chain(k), LLVM, fusion="search")
        counts.append(checks[0])
    assert 0 < counts[1] <= 2.1 * counts[0]
