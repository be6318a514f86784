"""CPU size variants: a kernel of symbolic row count that cuts few long rows into chunks where the size calls for it.

The CPU plan for every size of a symbolic row count runs row tasks over the
cores; a static count of few long rows has each row cut into chunks over the
cores instead (planning/cpu/tasks.row_chunks). For a kernel whose rows have a
static length, the counts the rules cut (planning/cpu/variants.chunked_range)
get one variant: the plan a static build makes at the smallest of them (the
rule plan, or the CPU cost model's choice among its candidates as
`Planner.choose` gives it), kept where the rule plan there cuts rows. It is
joined with the plan for every size under one dispatch on the host
(kernels/variants.dispatching), the plan for every size last.

The cost model ranks the candidates of one static size: it has no time and no
feature for the chunks, so it cannot price the chunked plan against the plan
for every size; the rules decide where rows are cut.
"""

from __future__ import annotations

from tvm import tirx

from tvm_stitch.analysis.size_bounds import at_sizes, size_bounds
from tvm_stitch.analysis.tir_view import static_product
from tvm_stitch.kernels.variants import Planner, whole_row_size
from tvm_stitch.planning.cpu.variants import chunked, chunked_range
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.variants import Variant


def cpu_row_size(fused: tirx.PrimFunc, plan: StitchPlan) -> tirx.Var | None:
    """The symbolic size that is the row count of a CPU row-resident plan for every size, when it is
    the kernel's only size, a whole row axis of every parameter holding it, and the rules cut rows
    of the kernel's (static) length into chunks at some count within its bounds; else None."""
    found = _chunked(fused, plan)
    return found[0] if found is not None else None


def _chunked(fused: tirx.PrimFunc, plan: StitchPlan) -> tuple | None:
    """(the size, planning/cpu/variants.chunked_range of the kernel's rows, the smallest count
    within the bounds) where `cpu_row_size` finds the size; else None. The rows are the leading
    `plan.rank` axes of the parameter holding the size, of which the size is one."""
    m = plan.mapping
    if (plan.spec is None or plan.spec.family != "cpu" or plan.scheme != "row-resident" or m.rows >= 0
            or m.split > 1 or m.rows_per_task > 1 or plan.bounds or plan.row_axes):
        return None
    var = whole_row_size(fused, plan.rank)
    if var is None:
        return None
    out = next(p for p in fused.params if any(d.same_as(var) for d in p.ty.shape))
    low, high = size_bounds(fused).get(var.name, (None, None))
    others = static_product(d for d in out.ty.shape[:plan.rank] if not d.same_as(var))
    condition = chunked_range(var.name, low, high, static_product(out.ty.shape[plan.rank:]), plan.spec.cores, others)
    return (var, condition, max(1, low or 1)) if condition is not None else None


def cpu_size_variants(fused: tirx.PrimFunc, general: StitchPlan, planner: Planner) -> tuple:
    """The chunked variant worth compiling besides `general` (valid for every size), as a tuple for
    the dispatch; () where the rules cut rows at no count within the bounds, or the rule plan at the
    smallest count does not."""
    found = _chunked(fused, general)
    if found is None:
        return ()
    var, condition, first = found
    smallest = at_sizes(fused, {var.name: first})
    rule = planner.rule(smallest)
    if not chunked(rule):
        return ()
    plan = planner.choose(smallest, rule)
    return (Variant(condition, plan if chunked(plan) else rule, first),)
