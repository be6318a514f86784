"""explain(mod, target): the stitch plan of every kernel, without building."""

from __future__ import annotations

import tvm

from .pipeline import stitch_passes
from .report import StitchReport
from .target import as_target


def explain(mod: tvm.IRModule, target, *, strict: bool = False, fast_math: bool | None = None) -> StitchReport:
    """Run the grouping and planning steps of the pipeline on a copy of `mod`.

    Returns a StitchReport: per group its ops, the kernel's plan (dominant
    op, scheme, thread mapping, reuse level of every intermediate, modeled
    traffic) or the reason it fell back. `print()` shows it as a table;
    `.details()` in full.
    """
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"explain expects a Relax IRModule, got {type(mod).__name__}")
    target = as_target(target)
    report = StitchReport()
    passes = stitch_passes(target, strict=strict, report=report, fast_math=fast_math)
    with target:
        tvm.transform.Sequential(passes)(tvm.IRModule(mod.functions, attrs=mod.attrs))
    return report
