"""The stages of one group: outline, plan, schedule, each returning a value; identical groups share one kernel.

A group that succeeds becomes a `Kernel` (a scheduled PrimFunc with its plan attached, attribute
`tirx.is_scheduled` so dlight leaves it alone, and `tvm_stitch.plan` holding the plan), with its size
variants where the size calls for them; one that fails is an `Attempt` with the stage it stopped after and
its `Reason`. The plan to build is the chooser's (`choose(fused, rule plan, spec, prices)`, the kernel's
plans priced so far given to it); the maker decides nothing itself.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi

from schedules import schedule_for
from tvm_stitch.analysis.size_bounds import at_upper_bounds, with_size_bounds
from tvm_stitch.kernels.builds import check_builds
from tvm_stitch.kernels.cpu_variants import cpu_row_size, cpu_size_variants
from tvm_stitch.kernels.outline import outline_group
from tvm_stitch.kernels.packing import packable
from tvm_stitch.kernels.timed_packing import walk_in_time
from tvm_stitch.kernels.variants import Planner, dispatching, row_size, size_variants
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.reasons import reason_of
from tvm_stitch.pricing.idle_guard import with_idle_reason
from tvm_stitch.pricing.modeled_time import with_modeled_time
from tvm_stitch.pricing.plan_prices import PlanPrices
from tvm_stitch.pricing.price_memo import PriceMemo
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.stitch.records import OUTLINED, PLANNED, SCHEDULED, Attempt, Block, Kernel, StitchError, make_group
from tvm_stitch.stitch_target import StitchTarget


class KernelMaker:
    """One module's kernels: each group outlined, planned and scheduled for `target` once."""

    def __init__(self, mod: tvm.IRModule, target: StitchTarget, strict: bool, choose=None):
        self.mod = mod
        self.target = target
        self.strict = strict
        self.choose = choose  # (fused, rule plan, spec, prices) -> the plan to use; None: the rule plan
        self.kernels: dict = {}  # name -> Kernel
        self.done: dict = {}  # structural hash of a fused PrimFunc -> [(fused, Kernel)]
        self.memo = PriceMemo()  # the module's plans priced, per structural key of their kernel
        self.notes: list = []  # what the report says of how kernels were made
        # name -> Kernel: the thread-per-column plan of a one-launch column-split kernel, which packing
        # may share a launch with others (grouping/packing.packed_kernels)
        self.walks: dict = {}

    def attempt(self, block: Block, members: list, recomputed: tuple = ()) -> Attempt:
        """Outline, plan and schedule a group (identical groups share one kernel); a fallback attempt
        with the reason where a stage fails."""
        group = make_group(block, members, recomputed)
        reached = ""
        try:
            outlined = outline_group(self.mod, block.graph, members, f"stitch_{len(self.kernels)}", recomputed)
            reached = OUTLINED
            fused = with_size_bounds(outlined.func, outlined.args, block.bounds)
            kernel = self._known(fused)
            if kernel is None:
                prices = PlanPrices(self.target.spec, self.memo)  # the kernel's plans priced, each code lowered once
                name, rule, plan = self._plan(fused, group.ops, prices)
                reached = PLANNED
                kernel = self._add(fused, self._built(fused, name, rule, plan, prices))
                self._walk_variant(fused, kernel)
        except Exception as err:  # noqa: BLE001 - any failure of a group means: fall back
            reason = reason_of(err)
            if self.strict:
                raise StitchError(f"cannot stitch {list(group.ops)}: {reason.text}") from err
            return Attempt(group, reached, reason=reason)
        return Attempt(group, SCHEDULED, outlined=outlined, kernel=kernel)

    def _known(self, fused: tvm.tirx.PrimFunc) -> Kernel | None:
        """The kernel already made of a fused PrimFunc structurally equal to `fused`, if any."""
        for other, kernel in self.done.get(tvm_ffi.structural_hash(fused), []):
            if tvm_ffi.structural_equal(other, fused):
                return kernel
        return None

    def _plan(self, fused: tvm.tirx.PrimFunc, ops: tuple, prices: PlanPrices) -> tuple:
        """(kernel name, rule plan, the plan to build: the rule plan or the chooser's)."""
        name = f"stitch_{len(self.kernels)}_{'_'.join(ops[:3])}"[:60]
        rule = plan_kernel(fused, self.target.spec, name)
        return name, rule, self._choice(fused, rule, prices)

    def _choice(self, fused: tvm.tirx.PrimFunc, rule: StitchPlan, prices: PlanPrices) -> StitchPlan:
        """The chooser's plan (the rule plan where none chooses), given the kernel's plans priced so far."""
        if self.choose is None:
            return rule
        return self.choose(fused, rule, self.target.spec, prices)

    def _add(self, fused: tvm.tirx.PrimFunc, kernel: Kernel) -> Kernel:
        self.kernels[kernel.name] = kernel
        self.done.setdefault(tvm_ffi.structural_hash(fused), []).append((fused, kernel))
        self.notes.extend(kernel.notes)
        return kernel

    def _built(self, fused: tvm.tirx.PrimFunc, name: str, rule: StitchPlan, plan: StitchPlan,
               prices: PlanPrices) -> Kernel:
        """The kernel of `plan` with its size variants where some are built. A kernel that may get
        variants is checked once: the dispatch's build check covers the plan for every size (its
        last branch); without variants it is checked alone, rescheduled as `_scheduled` does
        where it fails."""
        if row_size(fused, plan) is None and cpu_row_size(fused, plan) is None:
            return self._size_variants(fused, self._scheduled(fused, name, rule, plan), prices)
        kernel = self._size_variants(fused, self._scheduled(fused, name, rule, plan, checked=False), prices)
        if kernel.variants:
            return kernel
        try:
            check_builds(kernel.func, self.target.target)
        except Exception:  # noqa: BLE001 - the check _scheduled makes, and its fallback to the rule plan
            return self._scheduled(fused, name, rule, plan)
        return kernel

    def _scheduled(self, fused: tvm.tirx.PrimFunc, name: str, rule: StitchPlan, plan: StitchPlan,
                   checked: bool = True) -> Kernel:
        """The kernel of `plan` (the rule plan where the chooser's plan does not build), with its
        modeled traffic and time; `checked`: whether `plan`'s kernel is build-checked here."""
        notes = ()
        try:
            scheduled = self._schedule(fused, plan, checked)
        except Exception as err:  # noqa: BLE001 - the model's choice failed: the rules' plan is the fallback
            if plan is rule:
                raise
            notes = (f"{name}: the cost model's choice did not build ({type(err).__name__}); the rule plan is used",)
            plan, scheduled = rule, self._schedule(fused, rule)
        plan = self._measured(fused, scheduled, plan)
        return Kernel(name, plan, scheduled.with_attr("tvm_stitch.plan", plan.to_json()), notes)

    def _measured(self, fused: tvm.tirx.PrimFunc, scheduled: tvm.tirx.PrimFunc, plan: StitchPlan) -> StitchPlan:
        """`plan` with the modeled traffic of its kernel (at the symbolic sizes' upper bounds where
        the sizes alone leave it unknown) and its modeled time."""
        spec = self.target.spec
        traffic = modeled_traffic(scheduled, spec)
        if traffic is None:
            at_bounds, values = at_upper_bounds(scheduled)
            traffic = modeled_traffic(at_bounds, spec) if at_bounds is not None else None
            if traffic is not None:
                sizes = ", ".join(f"{name} = {value}" for name, value in sorted(values.items()))
                plan = dataclasses.replace(plan, notes=plan.notes + (
                    f"modeled traffic at the upper bounds of the symbolic sizes ({sizes})",))
        if traffic is not None:
            plan = dataclasses.replace(plan, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        cuda = scheduled if self.target.builds_cuda else None
        return with_idle_reason(with_modeled_time(plan, fused, spec, cuda), fused, spec, cuda)

    def _size_variants(self, fused: tvm.tirx.PrimFunc, kernel: Kernel, prices: PlanPrices) -> Kernel:
        """`kernel` choosing at run time among the plans its symbolic row count calls for, where one
        plan does not serve every size best (kernels/variants.py); `prices`: the kernel's plans priced."""
        spec = self.target.spec
        planner = Planner(rule=lambda static: plan_kernel(static, spec, kernel.name, rows_first=False),
                          choose=lambda static, rule: (self._choice(static, rule, prices) if self.choose is not None
                                                       else with_modeled_time(rule, static, spec)),
                          price=prices.plan_times,
                          priced=prices.scheduled_times,
                          schedule=lambda func, plan: schedule_for(func, plan, self.target.target).mod["main"],
                          device=self.target.builds_cuda)
        try:
            variants = (size_variants(fused, kernel.plan, kernel.func, planner) if self.target.family == "cuda"
                        else cpu_size_variants(fused, kernel.plan, planner))
            if not variants:
                return kernel
            func, variants = dispatching(fused, kernel.func, variants, planner)
            func = func.with_attr("tirx.is_scheduled", True)
            check_builds(func, self.target.target)
        except Exception as err:  # noqa: BLE001 - the variants are an optimisation: the plan for every size stays
            self.notes.append(f"{kernel.name}: size variants not built ({type(err).__name__}: {err})")
            return kernel
        return dataclasses.replace(kernel, func=func, variants=variants)

    def _walk_variant(self, fused: tvm.tirx.PrimFunc, kernel: Kernel) -> None:
        """Record the thread-per-column plan of a one-launch column-split kernel when it is packable."""
        if kernel.plan.scheme != "column-split" or kernel.plan.kernels != 1:
            return
        try:
            walk = plan_kernel(fused, self.target.spec, kernel.name, columns=False)
            if not packable(walk):
                return
            scheduled = self._schedule(fused, walk)
        except Exception:  # noqa: BLE001 - no variant: the column-split kernel stays
            return
        traffic = modeled_traffic(scheduled, self.target.spec)
        if traffic is not None:
            walk = dataclasses.replace(walk, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        walk = with_modeled_time(walk, fused, self.target.spec, scheduled if self.target.builds_cuda else None)
        if not walk_in_time(walk, kernel.plan, self.target.spec):
            return
        self.walks[kernel.name] = Kernel(kernel.name, walk, scheduled.with_attr("tvm_stitch.plan", walk.to_json()))

    def _schedule(self, fused: tvm.tirx.PrimFunc, plan: StitchPlan, checked: bool = True) -> tvm.tirx.PrimFunc:
        sch = schedule_for(fused, plan, self.target.target)
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        if checked:
            check_builds(scheduled, self.target.target)
        return scheduled
