"""TIR schedules that realise stitch plans: one module per scheme and target."""

from __future__ import annotations

from types import MappingProxyType

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.analysis.reshaped_rows import rows_through_reshape
from tvm_stitch.analysis.row_axes import ROW_AXES_ATTR, rows_first
from tvm_stitch.planning.plan import StitchPlan

from .cpu import row_resident as cpu_row_resident
from .cuda import column_split as cuda_column_split
from .cuda import mix_order as cuda_mix_order
from .cuda import row_resident as cuda_row_resident
from .cuda import row_split as cuda_row_split
from .intrinsics import expand_intrinsics

_RULES = MappingProxyType({
    ("cuda", "row-resident"): cuda_row_resident.apply,
    ("cuda", "row-split"): cuda_row_split.apply,
    ("cuda", "column-split"): cuda_column_split.apply,
    ("cuda", "mix-order"): cuda_mix_order.apply,
    ("cpu", "row-resident"): cpu_row_resident.apply,
})


def schedule_for(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    """Apply the rule that realises `plan` on `target` (to `func` with its row axes moved first,
    where the plan's rows are not leading, or with the blocks it re-lays over the rows of a reshape; on llvm, with the intrinsics TVM lowers for scalars only
    written as others, schedules/intrinsics: the schedules vectorise)."""
    rule = _RULES.get((plan.target, plan.scheme))
    if rule is None:
        raise ValueError(f"no schedule for scheme {plan.scheme!r} on {plan.target}")
    if target.kind.name == "llvm":
        func = expand_intrinsics(func)
    if plan.reshaped and (func.attrs is None or ROW_AXES_ATTR not in func.attrs):
        func = rows_through_reshape(func, plan.reshaped)
    if plan.row_axes and (func.attrs is None or ROW_AXES_ATTR not in func.attrs):
        func = rows_first(func, plan.row_axes)
    return rule(func, plan, target)
