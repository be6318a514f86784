"""Schedule steps shared by the row-resident rules of every target."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block

from tvm_stitch.planning.plan import StitchPlan


def blocks_by_name(sch: s_tir.Schedule) -> dict:
    return {sch.get(b).name_hint: b for b in sch.get_child_blocks(get_root_block(sch))}


def inline_cheap_blocks(sch: s_tir.Schedule, plan: StitchPlan) -> None:
    """Inline the blocks the plan keeps at register level, last first."""
    for name in reversed(plan.inlined()):
        sch.compute_inline(sch.get_sblock(name))


def merge_row_loops(sch: s_tir.Schedule, plan: StitchPlan):
    """Fuse each block's row loops and merge them into one loop over rows.

    Returns the merged row loop; every block of the kernel is below it, in
    program order. A kernel with no row axis gets a unit row loop.
    """
    row_loops = []
    for block in blocks_by_name(sch).values():
        loops = sch.get_loops(block)
        if loops and any(sch.get(loops[0]).same_as(sch.get(r)) for r in row_loops):
            continue  # shares its loop nest with a block already handled (an rfactor pair)
        if plan.rank == 0:
            row_loops.append(sch.add_unit_loop(loops[0] if loops else block))
        elif plan.rank == 1:
            row_loops.append(loops[0])
        else:
            row_loops.append(sch.fuse(*loops[: plan.rank]))
    if len(row_loops) == 1:
        return row_loops[0]
    return sch.merge(*row_loops)


def loops_extent(sch: s_tir.Schedule, loops) -> int | None:
    """The product of the loops' extents; None if any is symbolic."""
    total = 1
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return None
        total *= int(extent.value)
    return total


def loop_kinds(sch: s_tir.Schedule, block) -> list:
    """(loop, iter type) for each loop of a block: the type of the block iterator the loop
    is bound to directly, None for a loop no iterator is bound to alone."""
    loops = sch.get_loops(block)
    node = sch.get(block)
    realize = sch.get(loops[-1]).body if loops else None
    kind_of = []
    if isinstance(realize, s_tir.SBlockRealize):
        kind_of = [(value, iv.iter_type) for iv, value in zip(node.iter_vars, realize.iter_values)
                   if isinstance(value, tirx.Var)]
    out = []
    for loop in loops:
        var = sch.get(loop).loop_var
        out.append((loop, next((k for v, k in kind_of if v.same_as(var)), None)))
    return out


def within_row_loops(sch: s_tir.Schedule, block, row_loop) -> tuple:
    """(spatial, reduction) loops of a block below the row loop."""
    kinds = loop_kinds(sch, block)
    row = sch.get(row_loop)
    position = next((i for i, (loop, _) in enumerate(kinds) if sch.get(loop).same_as(row)), -1)
    spatial, reduce = [], []
    for loop, kind in kinds[position + 1:]:
        (reduce if kind == tirx.IterVar.CommReduce else spatial).append(loop)
    return spatial, reduce
