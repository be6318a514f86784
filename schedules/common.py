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


def recompute_in_readers(sch: s_tir.Schedule, names: tuple) -> None:
    """Let the blocks that read each element-wise output block of `names` recompute its value
    instead of loading the output (row-split: a per-row mean that another block of the same
    kernel would otherwise read before it is written). The output is then written by a copy
    stage (s_tir names it after the block's buffer) that computes the value too."""
    for name in names:
        block = sch.get_sblock(name)
        stage = sch.cache_write(block, 0, "global", consumer_blocks=sch.get_consumers(block))
        rows_first_in_stage(sch, block, stage, len(sch.get(block).iter_vars))
        sch.compute_inline(block)


def rows_first_in_stage(sch: s_tir.Schedule, producer, stage, rank: int) -> None:
    """Bring the row iterators of a cache stage first (`stage`: the copy `cache_write` made of
    `producer`'s result, iterating over the parameter's layout).

    Where the rows are not the parameter's leading dimensions (plan.row_axes), the copy's
    leading iterators are not rows; the producer's first `rank` iterators name the
    dimensions that are (all of an element-wise producer's: the copy then iterates in its order).
    """
    node = sch.get(producer)
    row_vars = [iv.var for iv in node.iter_vars[:rank]]
    indices = [r.min for r in node.writes[0].region]
    dims = []
    for var in row_vars:
        found = [d for d, index in enumerate(indices) if isinstance(index, tirx.Var) and index.same_as(var)]
        if len(found) != 1:
            return
        dims.append(found[0])
    if dims == list(range(rank)):
        return
    iters = sch.get(stage).iter_vars

    def moved(*ivs):
        return tuple(ivs[d] for d in dims) + tuple(v for d, v in enumerate(ivs) if d not in dims)

    sch.transform_block_layout(stage, tirx.IndexMap.from_func(moved, ndim=len(iters),
                                                              index_dtype=str(iters[0].var.ty)))


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
