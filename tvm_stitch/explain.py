"""explain(mod, target): the stitch plan of every kernel, without building."""

from __future__ import annotations

import tvm
from tvm import relax

from .precision import AccumulateInFloat32
from .report import StitchReport
from .stitch_pass import StitchFusion
from .target import as_target, backend_passes


def explain(mod: tvm.IRModule, target, *, strict: bool = False) -> StitchReport:
    """Run the grouping and planning steps of the pipeline on a copy of `mod`.

    Returns a StitchReport: per group its ops, the kernel's plan (dominant
    op, scheme, thread mapping, reuse level of every intermediate) or the
    reason it fell back. `print()` shows it as a table; `.details()` in full.
    """
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"explain expects a Relax IRModule, got {type(mod).__name__}")
    target = as_target(target)
    report = StitchReport()
    passes = backend_passes(target).library_dispatch_passes(target) + [
        AccumulateInFloat32(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        StitchFusion(target, strict=strict, report=report),
    ]
    with target:
        tvm.transform.Sequential(passes)(tvm.IRModule(mod.functions, attrs=mod.attrs))
    return report
