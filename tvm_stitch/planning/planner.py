"""The plan of a fused PrimFunc for a target: the schemes tried, in order, per target.

CUDA (`_cuda_plan`): column reductions as column-split (planning/cuda/column_split.py),
row-split for few long rows (planning/row_split.py), else row-resident
(planning/cuda/) with AStitch's demotion, else row-split for rows that do not
fit on chip. CPU: row-resident (planning/cpu/). The rules
every target shares (levels, rows) are planning/row_resident.py's.
Anything the schemes cannot express raises PlanError with the reason; the
caller then leaves the group to TVM's default path.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx

from tvm_stitch.analysis.row_axes import find_row_axes, rows_first
from tvm_stitch.analysis.size_bounds import ATTR as SIZE_BOUNDS
from tvm_stitch.analysis.tir_view import static_product
from tvm_stitch.planning import row_resident
from tvm_stitch.planning.common import Analyses, PlanError
from tvm_stitch.planning.cpu import row_resident as cpu_row_resident
from tvm_stitch.planning.cuda.column_split import ColumnError, plan_column_split
from tvm_stitch.planning.cuda import row_resident as cuda_row_resident
from tvm_stitch.planning.cuda.demotion import plan_demoting
from tvm_stitch.planning.cuda.mix_order import MixOrderError, plan_mix_order
from tvm_stitch.planning.cuda.row_resident import SharedMemoryError
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.resources import with_resources
from tvm_stitch.planning.row_resident import Analysis
from tvm_stitch.planning.row_split import SplitError, plan_row_split
from tvm_stitch.planning.spec import TargetSpec

__all__ = ["Analysis", "PlanError", "SharedMemoryError", "analyse", "plan_kernel", "plan_row_resident"]


def _row_rules(family: str):
    """The row-resident rules of a target family (a module with LEVELS and plan)."""
    return cuda_row_resident if family == "cuda" else cpu_row_resident


def analyse(func: tirx.PrimFunc, family: str, recompute: tuple = (), analyses: Analyses | None = None) -> Analysis:
    """The rank-independent analysis of a fused PrimFunc for a target family (PlanError if the
    row-resident scheme cannot hold it); made once per `analyses`."""
    return row_resident.analyse(func, family, _row_rules(family).LEVELS, tuple(recompute), analyses)


def plan_row_resident(func: tirx.PrimFunc, spec: TargetSpec, name: str, recompute: tuple = (),
                      rank: int | None = None, analysis: Analysis | None = None) -> StitchPlan:
    """The row-resident plan of a fused PrimFunc: levels first, then rows of what remains.

    `recompute`: blocks demoted from shared memory to recomputation in their consumers.
    `rank` fixes the number of leading axes that form the rows (at most the
    aligned depth); by default the rules choose it. `analysis` (from
    `analyse(func, spec.family, recompute)`) saves redoing it.
    """
    return _row_rules(spec.family).plan(func, spec, name, tuple(recompute), rank, analysis)


def plan_kernel(func: tirx.PrimFunc, spec: TargetSpec, name: str, columns: bool = True,
                rows_first: bool = True) -> StitchPlan:
    """The plan of a fused PrimFunc for the target `spec` describes, its row axes moved first
    where its blocks share more rows at axes that do not lead. `columns=False`: no column-split
    plan (the thread-per-column walk, which packing can share a launch with others);
    `rows_first=False`: the leading axes are the rows (no search for others). The schemes tried
    share one set of block views and inlining trials (`Analyses`)."""
    analyses = Analyses()
    moved, row_axes = _rows_moved_first(func, spec.family, analyses) if rows_first else (func, ())
    if spec.family != "cuda":
        plan = plan_row_resident(moved, spec, name, analysis=analyse(moved, spec.family, (), analyses))
    else:
        plan = with_resources(_cuda_plan(moved, spec, name, columns, analyses))
    if not row_axes:
        return plan
    positions = sorted({p for _, p, _ in row_axes})
    split = sorted({k for _, _, factors in row_axes for k in factors if k})
    note = (f"rows are not the leading axes: block iterators {', '.join(map(str, positions))} "
            f"(of {len(row_axes)} blocks) moved first"
            + (f", split by {', '.join(map(str, split))} where a row is a quotient" if split else "")
            + "; the kernel's tensors are read and written as strided slices per row")
    return dataclasses.replace(plan, row_axes=row_axes, notes=plan.notes + (note,))


def _cuda_plan(func: tirx.PrimFunc, spec: TargetSpec, name: str, columns: bool, analyses: Analyses) -> StitchPlan:
    """The CUDA schemes, in order: row and column reductions of the same rows as mix-order; column
    reductions as column-split (with a combine launch only
    where row-split would take one too); row-split for few long rows; row-resident, demoting shared
    intermediates until a row fits; a row planned for the bound of its symbolic length that keeps
    nothing on chip streams; row-split for rows that do not fit on chip."""
    try:
        return plan_mix_order(func, spec, name, analyses)
    except MixOrderError:
        pass
    split, not_split = None, None
    try:
        split = plan_row_split(func, spec, name, few_long_rows_only=True, analyses=analyses)
    except SplitError as err:
        not_split = err
    if columns:
        try:
            return plan_column_split(func, spec, name, split is not None and split.kernels > 1, analyses)
        except ColumnError:
            pass
    if split is not None:
        return split
    try:
        return _with_idle_note(plan_demoting(func, spec, name, analyses), spec, not_split)
    except SharedMemoryError as err:
        if err.bounded:
            return _streamed(func, spec, name, err, columns, analyses)
        try:
            return plan_row_split(func, spec, name, few_long_rows_only=False, analyses=analyses)
        except SplitError as split_err:
            raise PlanError("no-scheme", row_resident=err.reason, row_split=split_err.reason) from err


def _with_idle_note(plan: StitchPlan, spec: TargetSpec, not_split: SplitError) -> StitchPlan:
    """`plan`, saying why SMs it leaves idle are left idle."""
    if not 0 < plan.mapping.grid < spec.sms:
        return plan
    return dataclasses.replace(plan, notes=plan.notes + (
        f"{plan.mapping.grid} blocks for {spec.sms} SMs, not split over more: {not_split}",))


def _streamed(func: tirx.PrimFunc, spec: TargetSpec, name: str, err: SharedMemoryError, columns: bool,
              analyses: Analyses) -> StitchPlan:
    """Planned for the bound, no part of the row fits on chip: streamed, as for any length."""
    sizes = ", ".join(f"{n} <= {u}" for n, u in err.bounded)
    plan = _cuda_plan(func.without_attr(SIZE_BOUNDS), spec, name, columns, analyses)
    return dataclasses.replace(plan, notes=plan.notes + (
        f"planned for the bound of its symbolic length ({sizes}), no row-sized part stays on "
        f"chip ({err}): streamed instead",))


def _rows_moved_first(func: tirx.PrimFunc, family: str, analyses: Analyses) -> tuple:
    """(func with its row axes first, the row axes) when its blocks share more rows at axes that
    do not lead than at leading ones (BatchNorm on NCHW: the channel, where no leading axis is
    shared; GroupNorm: (batch, group), where only the batch leads); else (func, ())."""
    try:
        leading = _row_count(analyse(func, family, (), analyses))
    except PlanError:
        return func, ()  # the plan below says why
    row_axes = find_row_axes(func)
    if row_axes is None or leading is None:
        return func, ()
    try:
        moved = rows_first(func, row_axes)
        if (_row_count(analyse(moved, family, (), analyses)) or 0) <= leading:
            return func, ()
    except (PlanError, s_tir.ScheduleError):
        return func, ()
    return moved, row_axes


def _row_count(analysis: Analysis) -> int | None:
    """Row tasks at the aligned depth (1 at depth 0; None when symbolic)."""
    return static_product(analysis.kept[0].extents[:analysis.depth]) if analysis.kept else None
