"""The Relax pipeline per target: TVM's default passes with the stitch pass inside.

    CUDA only: FoldHostConstants (rewrites/host_constants: bindings that read
        no parameter evaluated once on the host, before library dispatch
        makes a cumsum a scan kernel FoldConstant cannot run)
    FuseAttention (rewrites/attention: Q K^T, scale, mask, softmax, P V as one
        planned kernel per chain)
    CUDA only: ScatterAddsAtomically (rewrites/scatter_add: an accumulating
        scatter_nd, an embedding's gradient, as a kernel of atomic adds)
    ComputeClosedForms (rewrites/closed_forms: what depends on symbolic sizes
        alone, e.g. a decoder's causal mask, as kernels with no input that
        the stitched kernels reading them recompute)
    library dispatch (TVM)
    AccumulateInFloat32 (fp16/bf16 sums and transcendentals in fp32; on llvm
        all arithmetic),
    FastMath on llvm (rewrites/fast_math: vectorisable exp, erf, tanh, softmax,
        gelu, gelu_tanh, sigmoid, silu, softplus)
    llvm only: PatchifyAsMatmul (rewrites/patchify: a convolution whose stride
        is its kernel as a matmul of patches)
    LegalizeOps, AnnotateTIROpPattern (TVM)
    CUDA only: FoldProloguesIntoMatmuls (a cheap spatial op feeding only
        matmuls becomes part of them), RelabelMatmulEpilogues (the copies
        after a matmul join its epilogue where the time model says it pays);
        dlight's Matmul rule inlines both; llvm: RelabelMatmulEpilogues with
        rewrites/cpu_epilogue's policy (a reshape read by light element-wise
        ops joins the matmul)
    FoldConstant, FuseOps (TVM)
    CanonicalizeBindings, DeadCodeElimination (TVM, guarded): tuple
        projections of known tuples become their element, so a producer read
        through `(const, v)[1]` has stitchable readers only
    StitchFusion: memory-bound groups -> stitched, scheduled kernels
    FuseTIR (TVM): the remaining FuseOps groups (compute-intensive ops with
        their epilogues, fallbacks) become PrimFuncs as usual
    CUDA only: float16/bfloat16 GEMMs on tensor cores (schedules/cuda/
        tensor_core_matmul: mma.sync m16n8k16, sm_80 and later; float32
        ones on TF32 tensor cores, m16n8k8, with `allow_tf32`), then
        TVM's dlight rules for the rest, each guarded, then a per-block
        schedule that is always valid (dlight 0.27 crashes on some graphs);
        each function records the rule in `tvm_stitch.schedule_rule`;
        a GEMM both schedule keeps the faster by the time model
        (pricing/gemm_choice); dlight's tensor-core path is switched off first where TVM's
        Tensorize segfaults (tensorize_guard: a tvm-ffi newer than TVM's);
        then VectorSelectsAsBranches (a select under a vectorised loop as
        if_then_else: TVM's CUDA codegen emits code nvcc rejects for it)
    llvm only: tvm-stitch's CPU rules (schedules/cpu/contraction: matmuls and
        convolutions with their epilogues), each guarded; the rest stays as
        TVM leaves it
    dataflow lowering and finalisation (TVM)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.target import Target

from schedules.cpu import contraction
from schedules.cuda import per_block, tensor_core_matmul
from schedules.cuda.dlight_default import first_dlight_schedule
from schedules.cuda.vector_selects import selects_as_branches

from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.pricing.gemm_choice import faster_gemm, scheduled
from tvm_stitch.rewrites.attention import FuseAttention
from tvm_stitch.rewrites.closed_forms import ComputeClosedForms
from tvm_stitch.rewrites.cpu_epilogue import ReshapesJoin
from tvm_stitch.rewrites.fast_math import FastMath
from tvm_stitch.rewrites.host_constants import FoldHostConstants
from tvm_stitch.rewrites.epilogue_price import EpiloguePricer
from tvm_stitch.rewrites.matmul_epilogue import RelabelMatmulEpilogues
from tvm_stitch.rewrites.matmul_prologue import FoldProloguesIntoMatmuls
from tvm_stitch.rewrites.patchify import PatchifyAsMatmul
from tvm_stitch.rewrites.precision import AccumulateInFloat32
from tvm_stitch.rewrites.scatter_add import ScatterAddsAtomically
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch import DEFAULT_FUSION, StitchFusion
from tvm_stitch.stitch_target import StitchTarget
from tvm_stitch.target import backend_passes, warn_if_generic_cpu


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


def _tensor_core_schedule(func: tirx.PrimFunc, spec: TargetSpec, allow_tf32: bool):
    """schedules/cuda/tensor_core_matmul's schedule of `func`, or None where it does not apply or fails."""
    try:
        return tensor_core_matmul.apply(func, spec, allow_tf32)
    except Exception:  # noqa: BLE001 - a GEMM the rule cannot tensorize goes to dlight's rules
        return None


@tvm.transform.module_pass(opt_level=0, name="GuardedDefaultSchedule")
class GuardedDefaultSchedule:
    """dlight's default GPU rules, one at a time, with a per-block schedule as the last resort; before
    them, half-precision GEMMs on tensor cores (schedules/cuda/tensor_core_matmul).

    Each scheduled function records the rule that scheduled it ("tensor_core_matmul", the dlight
    rule's class name, or "per_block") in its `tvm_stitch.schedule_rule`
    attribute. `spec`: the target's TargetSpec, for the per-block schedule
    (default: made from the current target). `allow_tf32`: float32 GEMMs on TF32 tensor cores too.
    `timed` (the default): a GEMM the tensor-core rule schedules keeps the faster of that schedule and
    dlight's by the time model (pricing/gemm_choice.py), each choice recorded in `report.gemms`.
    """

    def __init__(self, spec: TargetSpec | None = None, allow_tf32: bool = False, timed: bool = True,
                 report: StitchReport | None = None):
        self.spec = spec
        self.allow_tf32 = allow_tf32
        self.timed = timed
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current(allow_none=False)
        spec = self.spec if self.spec is not None else TargetSpec.from_target(target)
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            tensor_core = _tensor_core_schedule(func, spec, self.allow_tf32)
            if tensor_core is not None:
                updates[gv] = self._gemm(func, tensor_core, target, spec, gv.name_hint)
                continue
            sch, name = first_dlight_schedule(func, target)
            if sch is None:
                sch, name = per_block.apply(func, spec), "per_block"
            updates[gv] = scheduled(sch, name)
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    def _gemm(self, func: tirx.PrimFunc, tensor_core, target: Target, spec: TargetSpec, name: str) -> tirx.PrimFunc:
        """The tensor-core schedule of a GEMM, or dlight's where `timed` and the time model prices it faster."""
        if not self.timed:
            return scheduled(tensor_core, TENSOR_CORE_RULE)
        chosen, choice = faster_gemm(func, tensor_core, target, spec, name)
        if self.report is not None:
            self.report.gemms.append(choice)
        return chosen


@tvm.transform.module_pass(opt_level=0, name="VectorSelectsAsBranches")
class VectorSelectsAsBranches:
    """Every PrimFunc's selects under a vectorised loop as `if_then_else` (schedules/cuda/vector_selects:
    TVM's CUDA code generator emits code nvcc rejects for a vectorised select)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {gv: selects_as_branches(func) for gv, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc)}
        for gv, func in updates.items():
            if not func.same_as(mod[gv]):
                mod[gv] = func
        return mod


CPU_RULES = (contraction.apply,)  # dlight's contract plus the spec: apply(func, target, spec) -> Schedule | None


@tvm.transform.module_pass(opt_level=0, name="GuardedCpuSchedule")
class GuardedCpuSchedule:
    """tvm-stitch's CPU rules for the PrimFuncs StitchFusion left (compute-intensive ops and fallbacks).

    dlight 0.27 has CPU rules for GEMV and reductions only, TVM's topi no x86
    schedules. A rule that does not apply, or raises, leaves the function as
    it was (TVM's unscheduled loop nest). `spec`: the target's TargetSpec
    (default: made from the current target, once: it reads the host's caches
    and thread count).
    """

    def __init__(self, spec: TargetSpec | None = None):
        self.spec = spec

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current(allow_none=False)
        spec = self.spec if self.spec is not None else TargetSpec.from_target(target)
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            for rule in CPU_RULES:
                try:
                    sch = rule(func, target, spec)
                except Exception:  # noqa: BLE001 - a failing rule leaves the function unscheduled
                    sch = None
                if sch is not None:
                    updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                    break
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


def grouping_passes(target, *, fast_math: bool | None = None, report: StitchReport | None = None) -> list:
    """The passes before StitchFusion: the graph it groups (FuseOps' output); the passes added to
    TVM's own are guarded (a failure skips them, noted in `report`, and so does a matmul boundary
    left in place: a producer dlight's Matmul rule would not schedule inside the matmul's kernel).
    `target`: a StitchTarget (or a target it is made from), given whole to every pass of the project's."""
    made = StitchTarget.of(target)
    target, gpu = made.target, made.builds_cuda
    if fast_math is None:
        fast_math = not gpu
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be True, False or None, not {fast_math!r}")
    return (
        # Before the GPU's library dispatch, which makes a cumsum a scan kernel FoldConstant cannot run;
        # on llvm, FoldConstant after LegalizeOps already evaluates what this folds.
        ([guarded(FoldHostConstants(report=report), report)] if gpu else [])
        # What a symbolic size leaves of those: each read binding one kernel of no input (recomputed
        # by its readers' stitched kernels), before the dispatch makes a cumsum a scan.
        # attention chains as one kernel each, while softmax is still a Relax op (FastMath rewrites it)
        # and a mask of constants is still Relax ops (ComputeClosedForms makes kernels of them)
        + [guarded(FuseAttention(made, report=report, fast_math=fast_math), report)]
        + ([guarded(ScatterAddsAtomically(made, report=report), report)] if gpu else [])
        + [guarded(ComputeClosedForms(report=report), report)]
        + backend_passes(target).library_dispatch_passes(target)
        + [guarded(AccumulateInFloat32(arithmetic=not gpu), report)]
        + ([guarded(FastMath(), report)] if fast_math else [])
        + ([guarded(PatchifyAsMatmul(), report)] if not gpu else [])
        + [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
        ]
        + ([guarded(FoldProloguesIntoMatmuls(made, report), report),
            guarded(RelabelMatmulEpilogues(EpiloguePricer(made, report)), report)]
           if gpu else [guarded(RelabelMatmulEpilogues(ReshapesJoin()), report)])
        + [
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            # `(const, v)[1]` -> `v`, unused bindings dropped: a producer read through such a
            # tuple would count as read by an opaque binding (no recompute, one more launch)
            guarded(relax.transform.CanonicalizeBindings(), report),
            guarded(relax.transform.DeadCodeElimination(), report),
        ]
    )


def stitch_passes(target, *, strict: bool = False, report: StitchReport | None = None,
                  emulate: str | None = None, fast_math: bool | None = None, cost_model: bool = True,
                  spec=None, fusion: str = DEFAULT_FUSION) -> list:
    """The passes up to and including StitchFusion (shared by `pipeline` and `explain`); `target`: a
    StitchTarget, or a target it is made from with `emulate` and `spec`."""
    if not isinstance(target, StitchTarget):
        target = StitchTarget.make(target, emulate, spec)
    stitch = StitchFusion(target, strict=strict, report=report, cost_model=cost_model, fusion=fusion)
    # Groups fall back one by one; a failure of the pass as a whole (a bug) leaves TVM's path.
    return (grouping_passes(target, fast_math=fast_math, report=report)
            + [stitch if strict else guarded(stitch, report)])


def pipeline(target, *, strict: bool = False, report: StitchReport | None = None,
             emulate: str | None = None, fast_math: bool | None = None,
             cost_model: bool = True, spec=None, fusion: str = DEFAULT_FUSION,
             allow_tf32: bool = False) -> tvm.transform.Pass:
    """A drop-in replacement for `relax.get_default_pipeline(target)` with stitching.

    `target`: a `tvm.target.Target`, or a dict / string naming a cuda or llvm
    target. `strict=True` raises instead of falling back. `report` (a
    `StitchReport`) receives every group's plan or fallback reason.
    `emulate="cuda"` (llvm targets only) builds the CUDA schedules without
    thread bindings, to run and check them on the CPU. `fast_math` replaces
    exp, erf, tanh, softmax, gelu, gelu_tanh, sigmoid, silu and softplus by
    vectorisable approximations (rewrites/fast_math.py; max relative error
    measured in tests/test_fast_math.py); the default is on for llvm
    targets, where libm's versions do not vectorise, and off for CUDA.
    `cost_model=True` (the default) lets the learned model
    (planning/cost_models/, CPU only) pick each kernel's configuration among
    the rule plan's variants; `False` keeps the rules alone. Plans are made
    for the target's `TargetSpec`, or for `spec` where given (see `StitchFusion`).
    `fusion="search"` (the default) groups by the fusion search, "greedy" by the greedy partition (see
    `StitchFusion`).
    `allow_tf32=True` (CUDA, sm_80 and later; off by default, as `torch.backends.cuda.matmul.allow_tf32`)
    lets float32 GEMMs run on TF32 tensor cores (mma.sync m16n8k8, float32 accumulators; products
    with TF32's 10-bit mantissa); off, float32 GEMMs stay exact.
    An llvm target without `mcpu` warns (GenericCpuWarning): see `target.host_target()`.
    """
    made = StitchTarget.make(target, emulate, spec)
    target = made.target
    warn_if_generic_cpu(target)
    passes = (
        stitch_passes(made, strict=strict, report=report, fast_math=fast_math, cost_model=cost_model, fusion=fusion)
        + [relax.transform.FuseTIR()]
        + ([GuardedDefaultSchedule(made.target_spec, allow_tf32, report=report),
            guarded(VectorSelectsAsBranches(), report)]
           if made.builds_cuda else [GuardedCpuSchedule(made.target_spec)])
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
