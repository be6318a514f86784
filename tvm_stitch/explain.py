"""explain(mod, target): the stitch plan of every kernel, without building."""

from __future__ import annotations

import tvm

from tvm_stitch.pipeline import grouping_passes, guarded
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch import DEFAULT_FUSION, StitchFusion
from tvm_stitch.stitch_target import StitchTarget
from tvm_stitch.target import warn_if_generic_cpu


def explain_with_graph(mod: tvm.IRModule, target, *, strict: bool = False,
                       fast_math: bool | None = None, cost_model=True, fusion: str = DEFAULT_FUSION) -> tuple:
    """(report, grouped module): `explain`'s report and the graph StitchFusion grouped (FuseOps' output)."""
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"explain expects a Relax IRModule, got {type(mod).__name__}")
    made = StitchTarget.make(target)
    target = made.target
    warn_if_generic_cpu(target)
    report = StitchReport()
    with target:
        grouped = tvm.transform.Sequential(grouping_passes(made, fast_math=fast_math, report=report))(
            tvm.IRModule(mod.functions, attrs=mod.attrs))
        stitch = StitchFusion(made, strict=strict, report=report, cost_model=cost_model, fusion=fusion)
        (stitch if strict else guarded(stitch, report))(tvm.IRModule(grouped.functions, attrs=grouped.attrs))
    return report, grouped


def explain(mod: tvm.IRModule, target, *, strict: bool = False, fast_math: bool | None = None,
            cost_model=True, fusion: str = DEFAULT_FUSION) -> StitchReport:
    """Run the grouping and planning steps of the pipeline on a copy of `mod`.

    Returns a StitchReport: per group its ops, the kernel's plan (dominant
    op, scheme, thread mapping, reuse level of every intermediate, modeled
    traffic, modeled time) or the reason it fell back. `print()` shows it as
    a table; `.details()` in full. `cost_model` as StitchFusion's (False:
    the rule plans, without choices among their variants). `fusion` as
    `pipeline`'s ("search", the default: the report says per block the plan used, its
    modeled time and greedy's, whether the optimum was proven, the solve time).
    """
    return explain_with_graph(mod, target, strict=strict, fast_math=fast_math, cost_model=cost_model,
                              fusion=fusion)[0]
