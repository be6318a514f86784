"""The time model's prices of one fused CUDA kernel's plans at static row counts, each code lowered once.

A timed choice (timed_choice.py) and the size-variant step (kernels/variants.py)
price several plans of one fused kernel: the rule plan and its neighbours at
one row count, the plan for every size and the variants at others. A plan is
scheduled and lowered (modeled_time.py) unless derived_geometry.py derives its
geometry from a plan lowered before by the same PlanPrices: the same code at
another row count, or the same rows packed otherwise into blocks. A derived
plan is neither scheduled nor lowered; its device-memory bytes are the modeled
traffic of its PrimFunc where one is given (a kernel scheduled for every size,
set to the count), else the lowered plan's at the same count (packing rows
otherwise moves the same bytes). One PlanPrices serves one fused kernel; the
module's PriceMemo (price_memo.py), where given, holds the times of plans
priced for structurally equal kernels before, which are not priced again.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from schedules import schedule_for
from tvm_stitch.analysis.size_bounds import at_upper_bounds
from tvm_stitch.pricing.derived_geometry import derivable, derived
from tvm_stitch.pricing.modeled_time import cuda_target, lowered_geometries, modeled_times
from tvm_stitch.pricing.price_memo import PriceMemo
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import kernel_time


@dataclass(frozen=True)
class _Lowered:
    """A plan lowered at `rows` rows: its kernels' geometries and its PrimFunc's modeled traffic."""

    plan: StitchPlan
    rows: int
    geometries: tuple
    dram_bytes: int


class PlanPrices:
    """KernelTimes of plans of one fused kernel (modeled_time.plan_times and modeled_times), each
    plan's geometry derived from a lowered one where derived_geometry.py says it is exact."""

    def __init__(self, spec: TargetSpec, memo: PriceMemo | None = None):
        self.spec = spec
        self.memo = memo if memo is not None else PriceMemo()  # the module's prices
        self.lowered: list = []  # _Lowered, in the order lowered

    def plan_times(self, fused: tirx.PrimFunc, plan: StitchPlan) -> list | None:
        """The KernelTimes of `plan`'s kernels for `fused` (modeled_time.plan_times), static at the
        plan's row count or, for a symbolic count, at the upper bound of its one size (the row
        count there, where derived_geometry.py checks it: it derives only from a grid that is the
        plan's at that count); None where the plan does not schedule or is not priced. Found in
        the module's memo where a structurally equal kernel's plan was priced."""
        return self.memo.times(fused, plan, lambda: self._plan_times(fused, plan))

    def _plan_times(self, fused: tirx.PrimFunc, plan: StitchPlan) -> list | None:
        rows = plan.mapping.rows
        found = self._derived(plan, rows, None) if rows > 0 else None
        if found is not None:
            return [kernel_time(g, self.spec) for g in found]
        try:
            scheduled = schedule_for(fused, plan, cuda_target(self.spec)).mod["main"]
        except Exception:  # noqa: BLE001 - a plan s_tir refuses has no time
            return None
        if rows > 0:
            return self.scheduled_times(scheduled, plan, rows)
        static, values = at_upper_bounds(scheduled)
        if static is None or len(values) != 1:
            return modeled_times(scheduled, self.spec, plan.registers, plan.kernel)
        return self.scheduled_times(static, plan, next(iter(values.values())))

    def scheduled_times(self, func: tirx.PrimFunc, plan: StitchPlan, rows: int) -> list | None:
        """The KernelTimes of the kernels of `func`, scheduled by `plan` and static at `rows` rows."""
        traffic = modeled_traffic(func, self.spec)
        if traffic is None:
            return modeled_times(func, self.spec, plan.registers, plan.kernel)
        found = self._derived(plan, rows, traffic.total)
        if found is None:
            found = lowered_geometries(func, self.spec, plan.registers, traffic.total, plan.kernel)
            if found is None:
                return None
            self.lowered.append(_Lowered(plan, rows, tuple(found), traffic.total))
        return [kernel_time(g, self.spec) for g in found]

    def _derived(self, plan: StitchPlan, rows: int, dram_bytes: int | None) -> list | None:
        """The geometries of `plan` at `rows` derived from a lowered plan (None: none derives): with
        `dram_bytes`, else with the lowered plan's where it was lowered at the same count."""
        for lowered in self.lowered:
            moved = dram_bytes if dram_bytes is not None else lowered.dram_bytes if lowered.rows == rows else None
            if moved is None or not derivable(lowered.plan, lowered.rows, plan, rows):
                continue
            found = derived(list(lowered.geometries), lowered.plan, lowered.rows, plan, rows, moved)
            if found is not None:
                return found
        return None
