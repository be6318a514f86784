"""The Relax pipeline per target: TVM's default passes with the stitch pass inside.

    library dispatch (TVM)
    LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps (TVM)
    AccumulateInFloat32 (fp16/bf16 sums and transcendentals in fp32; on llvm
        all arithmetic),
    FastMathTransform on llvm (vectorisable exp, erf, tanh)
    StitchFusion: memory-bound groups -> stitched, scheduled kernels
    FuseTIR (TVM): the remaining FuseOps groups (compute-intensive ops with
        their epilogues, fallbacks) become PrimFuncs as usual
    CUDA only: TVM's dlight rules for those, each guarded, then a per-block
        schedule that is always valid (dlight 0.27 crashes on some graphs)
    dataflow lowering and finalisation (TVM)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.target import Target

from schedules.cuda import per_block

from tvm_stitch.fusion.precision import AccumulateInFloat32
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch_pass import StitchFusion
from tvm_stitch.target import as_target, backend_passes


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


@tvm.transform.module_pass(opt_level=0, name="GuardedDefaultSchedule")
class GuardedDefaultSchedule:
    """dlight's default GPU rules, one at a time, with a per-block schedule as the last resort."""

    def __init__(self, report: StitchReport | None = None):
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from tvm.s_tir import dlight as dl

        target = Target.current(allow_none=False)
        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                 dl.gpu.Fallback()]
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            sch = None
            for rule in rules:
                try:
                    sch = rule.apply(func, target, False)
                except Exception:  # noqa: BLE001 - a crashing dlight rule means: try the next one
                    sch = None
                if isinstance(sch, list):
                    sch = sch[0] if sch else None
                if sch is not None:
                    break
            if sch is None:
                sch = per_block.apply(func)
            updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        for gv, func in updates.items():
            mod[gv] = func
        return mod


def guarded(inner: tvm.transform.Pass, report: StitchReport | None = None) -> tvm.transform.Pass:
    """`inner` (a pass this pipeline adds to TVM's), skipped with a note in `report` where it fails.

    Such a pass only improves a module TVM's default pipeline builds anyway:
    its failure on an odd module (FastMathTransform on `torch.cond`
    branches) must not stop the build.
    """
    name = inner.info.name

    @tvm.transform.module_pass(opt_level=0, name=f"Guarded{name}")
    def _guarded(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return inner(mod)
        except Exception as err:  # noqa: BLE001 - see the docstring
            if report is not None:
                lines = str(err).strip().splitlines()
                report.notes.append(f"{name} skipped: {type(err).__name__}: {lines[-1][:200] if lines else ''}")
            return mod

    return _guarded


def grouping_passes(target: Target, *, fast_math: bool | None = None, report: StitchReport | None = None) -> list:
    """The passes before StitchFusion: the graph it groups (FuseOps' output); the passes added to
    TVM's own are guarded (a failure skips them, noted in `report`)."""
    if fast_math is None:
        fast_math = target.kind.name == "llvm"
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be True, False or None, not {fast_math!r}")
    return (
        backend_passes(target).library_dispatch_passes(target)
        + [guarded(AccumulateInFloat32(arithmetic=target.kind.name == "llvm"), report)]
        + ([guarded(relax.transform.FastMathTransform(), report)] if fast_math else [])
        + [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
        ]
    )


def stitch_passes(target: Target, *, strict: bool = False, report: StitchReport | None = None,
                  emulate: str | None = None, fast_math: bool | None = None, cost_model: bool = True) -> list:
    """The passes up to and including StitchFusion (shared by `pipeline` and `explain`)."""
    stitch = StitchFusion(target, strict=strict, report=report, emulate=emulate, cost_model=cost_model)
    # Groups fall back one by one; a failure of the pass as a whole (a bug) leaves TVM's path.
    return grouping_passes(target, fast_math=fast_math, report=report) + [stitch if strict else guarded(stitch, report)]


def pipeline(target, *, strict: bool = False, report: StitchReport | None = None,
             emulate: str | None = None, fast_math: bool | None = None,
             cost_model: bool = True) -> tvm.transform.Pass:
    """A drop-in replacement for `relax.get_default_pipeline(target)` with stitching.

    `target`: a `tvm.target.Target`, or a dict / string naming a cuda or llvm
    target. `strict=True` raises instead of falling back. `report` (a
    `StitchReport`) receives every group's plan or fallback reason.
    `emulate="cuda"` (llvm targets only) builds the CUDA schedules without
    thread bindings, to run and check them on the CPU. `fast_math` replaces
    exp, erf and tanh by TVM's vectorisable approximations (max relative
    error measured in tests/test_fast_math.py); the default is on for llvm
    targets, where libm's versions do not vectorise, and off for CUDA.
    `cost_model=True` (the default) lets the learned model
    (schedules/cost_models/, CPU only) pick each kernel's configuration among
    the rule plan's variants; `False` keeps the rules alone.
    """
    target = as_target(target)
    passes = (
        stitch_passes(target, strict=strict, report=report, emulate=emulate, fast_math=fast_math,
                      cost_model=cost_model)
        + [relax.transform.FuseTIR()]
        + ([GuardedDefaultSchedule()] if target.kind.name == "cuda" else [])
        + backend_passes(target).dataflow_lower_passes(target)
        + backend_passes(target).finalize_passes(target)
    )

    @tvm.transform.module_pass(opt_level=0, name="tvm_stitch.pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not isinstance(mod, tvm.IRModule):
            raise TypeError(f"tvm_stitch.pipeline expects an IRModule, got {type(mod).__name__}")
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
