"""Compile time linear in the graph: a chain of K LayerNorms schedules work linear in K.

Counted, not timed: the TIR blocks of every plan the stitch pass schedules
(the kernels built and the plans priced). Identical kernels of a
chain cut into groups of a few LayerNorms (planning/limits.py: GROUP_REDUCTIONS)
are planned and priced once, so the count does not grow with K at all, where
one kernel of the whole chain made it grow as K times its candidate plans.
"""

from __future__ import annotations

import pytest
import tvm_stitch
from tvm_stitch.grouping import group_pricing
from tvm_stitch.planning.limits import GROUP_REDUCTIONS
from tvm_stitch.pricing import modeled_time, plan_prices
from tvm_stitch.stitch import kernel_maker
from tvm_stitch.tools.workloads import relax_blocks as rx

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


def scheduled_blocks(monkeypatch, k: int, target, fusion: str) -> int:
    """TIR blocks handed to schedules while `explain` compiles a chain of k LayerNorms."""
    counted = []
    for module in (kernel_maker, plan_prices, modeled_time, group_pricing):
        real = module.schedule_for

        def counting(func, plan, tgt, real=real):
            counted.append(len(plan.ops))
            return real(func, plan, tgt)
        monkeypatch.setattr(module, "schedule_for", counting)
    report = tvm_stitch.explain(chain(k), target, fusion=fusion)
    assert len(report.plans) == -(-k // PER_GROUP) and not report.fallbacks
    monkeypatch.undo()
    return sum(counted)


@pytest.mark.parametrize("target, fusion", [(CUDA, "greedy"), (LLVM, "greedy"), (CUDA, "search")],
                         ids=["cuda-greedy", "llvm-greedy", "cuda-search"])
def test_chain_schedules_the_same_work_at_every_length(monkeypatch, target, fusion):
    short = scheduled_blocks(monkeypatch, PER_GROUP, target, fusion)
    long = scheduled_blocks(monkeypatch, 3 * PER_GROUP, target, fusion)
    assert 0 < short == long
