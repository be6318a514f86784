"""StitchFusion: the Relax pass that stitches memory-bound groups into scheduled kernels.

Runs after FuseOps. Per Relax function and dataflow block, the block rewriter
(block_rewriter.py) groups the block's bindings and the kernel maker
(kernel_maker.py) outlines, plans and schedules each group for the
StitchTarget made once (stitch_target.py); a group that fails keeps its
original bindings (TVM's default path). The report is made from the
outcome at the end. This module only walks the module and makes the pass.
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax
from tvm.target import Target

from tvm_stitch.analysis.graph import analyses_for
from tvm_stitch.analysis.size_bounds import function_bounds
from tvm_stitch.grouping.fusion_search import FUNCTION_SECONDS, SEARCH_SECONDS
from tvm_stitch.planning import cost_model as _cost_model
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.timed_choice import choose_in_time
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch.bindings import used_after
from tvm_stitch.stitch.block_rewriter import BlockRewriter
from tvm_stitch.stitch.kernel_maker import KernelMaker
from tvm_stitch.stitch.records import DEFAULT_FUSION, FUSION_METHODS
from tvm_stitch.stitch_target import StitchTarget, check_spec, emulated
from tvm_stitch.target import as_target


def _rewritable(func) -> bool:
    """A Relax function of dataflow blocks the pass rewrites (not a primitive one)."""
    return (isinstance(func, relax.Function) and not (func.attrs is not None and func.attrs.get("Primitive"))
            and isinstance(func.body, relax.SeqExpr))


def _rewrite_function(rewriter: BlockRewriter, name: str, func: relax.Function, calls: dict) -> relax.Function | None:
    """`func` with each dataflow block's groups stitched (None when nothing changed)."""
    bounds = function_bounds(func)
    rewriter.budget.begin()
    blocks, changed = [], False
    for i, block in enumerate(func.body.blocks):
        if isinstance(block, relax.DataflowBlock):
            new_block = rewriter.rewrite_block(name, i, block, used_after(func, i), calls, bounds)
            changed |= new_block is not block
            blocks.append(new_block)
        else:
            blocks.append(block)
    if not changed:
        return None
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def stitch_module(mod: tvm.IRModule, target, strict: bool = False, report: StitchReport | None = None,
                  choose=None, fusion: str = DEFAULT_FUSION) -> tvm.IRModule:
    """Stitch `mod` for `target` (a StitchTarget, or a Target planned for its own TargetSpec).

    `choose(fused, rule_plan, spec, prices)` returns the plan to build (the time model's or the cost
    model's pick among candidates.py's variants; `prices`: the kernel's plans priced so far, a
    pricing.plan_prices.PlanPrices); None keeps the rule plan.
    `fusion`: "greedy" (partition.py) or "search" (fusion_search.py).
    """
    made = target if isinstance(target, StitchTarget) else StitchTarget.checked(as_target(target), None, None)
    report = report if report is not None else StitchReport()
    report.target = "cuda" if made.family == "cuda" else "llvm"
    report.spec = made.spec
    maker = KernelMaker(mod, made, strict, choose)
    rewriter = BlockRewriter(maker, fusion, (SEARCH_SECONDS, FUNCTION_SECONDS), analyses_for(mod))
    bb = relax.BlockBuilder(mod)
    calls = _LazyGlobals(bb, maker.kernels)
    for gv, func in list(mod.functions_items()):
        if _rewritable(func):
            new_func = _rewrite_function(rewriter, gv.name_hint, func, calls)
            if new_func is not None:
                bb.update_func(gv, new_func)
    rewriter.outcome.into(report, maker.kernels)
    out = bb.get()
    out = relax.transform.Normalize()(out)
    return relax.transform.DeadCodeElimination()(out)


class _LazyGlobals(dict):
    """GlobalVars of stitched PrimFuncs, added to the module on first use."""

    def __init__(self, bb: relax.BlockBuilder, kernels: dict):
        super().__init__()
        self.bb = bb
        self.kernels = kernels  # name -> Kernel

    def __missing__(self, name: str):
        gv = self.bb.add_func(self.kernels[name].func, name)
        self[name] = gv
        return gv

    def add(self, name: str, func) -> tvm.ir.GlobalVar:
        """A new kernel made here (a packed one), added under a fresh name."""
        gv = self.bb.add_func(func, name)
        self[gv.name_hint] = gv
        return gv


def StitchFusion(target: Target | dict | str | StitchTarget | None = None, *, strict: bool = False,
                 report: StitchReport | None = None, emulate=None,
                 cost_model=True, spec: TargetSpec | None = None, fusion: str = DEFAULT_FUSION) -> tvm.transform.Pass:
    """The stitch pass, for pipelines of your own: run it after FuseOps and before FuseTIR.

    `target` defaults to the current target scope; plans are made for its
    `TargetSpec` (SMs, shared memory, cores, vector width...), read once per
    pass (a `StitchTarget` holds both, made once by `pipeline`). With
    `strict=True` a group that cannot be stitched raises
    StitchError instead of falling back. A `StitchReport` passed as `report`
    receives the plan or the fallback reason of every group.
    `emulate="cuda"` with an llvm target plans and schedules every kernel as
    for CUDA sm_90, without thread bindings, so the CUDA schedules run (and
    can be checked) on the CPU; a cuda target (Target, dict or string)
    instead of "cuda" plans for that GPU. With `cost_model=True` (the
    default) each kernel's configuration is picked among the rule plan's
    variants: on CUDA by the time model (each variant scheduled and priced,
    pricing/timed_choice.py), on the CPU by the family's shipped learned model
    (cost_model.SHIPPED); a model given (a `cost_model.Model`,
    or any object whose `costs(feature rows)` ranks candidates, lowest
    first) is used as given; `False` uses the rules only. `spec` plans for
    that `TargetSpec` instead of the target's own (another core count, an
    SM count no target attribute sets); its family must be the one planned
    for. `fusion="search"` (the default) chooses the groups by the fusion
    search (an integer program over the groups' modeled times,
    grouping/fusion_search.py; greedy's plan where the search finds nothing
    cheaper); "greedy" by the greedy partition (grouping/partition.py).
    """
    if fusion not in FUSION_METHODS:
        raise ValueError(f"fusion must be one of {', '.join(FUSION_METHODS)}, not {fusion!r}")
    if isinstance(target, StitchTarget):
        if emulate is not None or spec is not None:
            raise TypeError("a StitchTarget already holds what emulate and spec would set")
        fixed, emulation = target, None
    else:
        emulation = emulated(emulate)
        check_spec(spec)
        fixed = StitchTarget.checked(as_target(target), emulation, spec) if target is not None else None
    if not (isinstance(cost_model, bool) or callable(getattr(cost_model, "costs", None))):
        raise TypeError(f"cost_model must be True, False or a model with costs(rows), not {cost_model!r}")

    @tvm.transform.module_pass(opt_level=0, name="StitchFusion")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        made = fixed
        if made is None:
            current = Target.current(allow_none=True)
            if current is None:
                raise ValueError("StitchFusion needs a target: pass one or run it inside `with target:`")
            made = StitchTarget.checked(as_target(current), emulation, spec)
        return stitch_module(mod, made, strict, report, chooser(cost_model, made.family), fusion)

    return _pass


def chooser(model, family: str):
    """choose(fused, rule, spec, prices) for the model asked for, or None where the rules decide; on CUDA
    the default (True) is the time model (pricing/timed_choice.py)."""
    if model is False:
        return None
    if model is True and family == "cuda":
        return choose_in_time
    if model is True:
        model = _cost_model.SHIPPED.get(family)
    if model is None:
        return None
    return functools.partial(_chosen_by_model, model)


def _chosen_by_model(model, fused, rule, spec, _prices):
    """A learned model's choice (it ranks the rule plan's variants by features, not by prices)."""
    return _cost_model.choose(model, fused, rule, spec)
