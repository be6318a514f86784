"""Row-resident stitching on the CPU: row tasks in parallel over cores.

The same plan as on CUDA: every block runs under the merged row loop, which
is parallel across cores; each row's intermediates are computed once into a
per-row buffer (TVM compacts the allocation to one row) that stays in cache,
and cheap ones are inlined. Element-wise loops inside a row are vectorised
by the plan's lane count where the row length allows.

Rows that are columns of their inputs (a reduction over the leading axis:
LayerNorm's dgamma, dbeta) are streamed: a task takes `rows_per_task`
adjacent rows, walks the reduction axis once and accumulates its rows in
vector lanes, so every load is contiguous.

Few long rows (fewer than the cores can share) are cut into chunks: each
block runs its chunks in parallel, reductions as per-chunk partials.

Short rows that reduce go across the vector lanes, a lane per row, where
the plan says so (`mapping.across`, planning/cpu/row_resident.lanes_across).
"""

from __future__ import annotations

from math import prod

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.planning.plan import MIN_LANES, StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks, loop_kinds, loops_extent, merge_row_loops, within_row_loops


def _split_reduction_lanes(sch: s_tir.Schedule, block, rank: int, lanes: int):
    """Split a row reduction by the vector width and rfactor the lanes; returns the lane block or None.

    Each lane accumulates its own partial result (a per-row buffer of `lanes`
    values); the original block then combines the lanes. Done on the block's
    own loop nest, before rows are merged: rfactor needs the reduction to be
    the first block under its outer loop.
    """
    loops = sch.get_loops(block)
    node = sch.get(block)
    within = loops[rank:]
    kinds = [iv.iter_type for iv in node.iter_vars[rank:]]
    reduce = [l for l, k in zip(within, kinds) if k == tirx.IterVar.CommReduce]
    spatial = [l for l, k in zip(within, kinds) if k != tirx.IterVar.CommReduce]
    if not reduce or len(within) != len(kinds) or not all(_unit(sch, l) for l in spatial):
        return None
    if within.index(reduce[0]) != len(spatial):
        return None
    # The fewest innermost reduction loops whose extents make whole vectors: outer ones
    # (BatchNorm's batch axis, strided in memory) stay loops around the lanes.
    extents = [loops_extent(sch, [l]) for l in reduce]
    if None in extents:
        return None
    count = next((n for n in range(1, len(reduce) + 1) if _vector_lanes(prod(extents[-n:]), lanes, 2)), None)
    if count is None:
        return None
    loop = sch.fuse(*reduce[-count:]) if count > 1 else reduce[-1]
    _, lane = sch.split(loop, [None, _vector_lanes(prod(extents[-count:]), lanes, 2)])
    return sch.rfactor(lane, 0)


def _vector_lanes(extent: int, lanes: int, steps: int = 1) -> int | None:
    """The widest power-of-two vector, at most `lanes` and at least MIN_LANES wide, that cuts
    `extent` into `steps` or more whole vectors; None if there is none."""
    width = lanes
    while width >= MIN_LANES:
        if extent % width == 0 and extent >= steps * width:
            return width
        width //= 2
    return None


def _unit(sch: s_tir.Schedule, loop) -> bool:
    extent = sch.get(loop).extent
    return isinstance(extent, tirx.IntImm) and extent.value == 1


def _stream_rows(sch: s_tir.Schedule, plan: StitchPlan) -> None:
    """Tasks of `rows_per_task` adjacent rows, the rows innermost and vectorised, in parallel.

    Per block: its row loops fused and split into (task, row in task), the
    row-in-task loop moved below the block's own loops (and cut into
    vectors of the plan's width), so that a task
    walks the reduction axis once for all its rows, each step one
    contiguous vector load per input. A reduction keeps its initialisation
    attached (on the first step): s_tir vectorises no loop over a
    decomposed update block. Blocks that read nothing another block writes
    share their walk (one pass over their common inputs).

    With `split` > 1 the reduced axis is cut into that many chunks: each
    (chunk, task) pair is a parallel iteration that sums its chunk into a
    partial (rfactor), and a second parallel loop over tasks combines the
    partials. Short sums are more accurate, and few columns still fill
    the cores.
    """
    per_task, split = plan.mapping.rows_per_task, plan.mapping.split
    names = list(blocks_by_name(sch))
    partials = []
    for name in names:
        block = sch.get_sblock(name)
        kinds = loop_kinds(sch, block)
        row = sch.fuse(*[l for l, _ in kinds[: plan.rank]]) if plan.rank > 1 else kinds[0][0]
        task, inner = sch.split(row, [None, per_task])
        within = [l for l, _ in kinds[plan.rank:]]
        if split > 1 and within and all(k == tirx.IterVar.CommReduce for _, k in kinds[plan.rank:]):
            chunk, _ = sch.split(sch.fuse(*within) if len(within) > 1 else within[0], [split, None])
            partial = sch.rfactor(chunk, 0)
            task, inner, chunk, step = sch.get_loops(partial)
            sch.reorder(chunk, task, step, inner)
            sch.fuse(chunk, task)
            partials.append(sch.get(partial).name_hint)
            task, inner, chunk = sch.get_loops(block)
            sch.reorder(chunk, inner)
        elif within:
            sch.reorder(*within, inner)
    for group in (partials, names):
        if not group:
            continue
        _merge_nests(sch, group)
        if plan.mapping.threads > 1:
            sch.parallel(sch.get_loops(sch.get_sblock(group[0]))[0])
        lanes = plan.mapping.vector
        for name in group:
            inner = sch.get_loops(sch.get_sblock(name))[-1]
            if sch.get(inner).kind == tirx.ForKind.VECTORIZED:
                continue  # a walk shared with a block already done
            if per_task > lanes > 1 and per_task % lanes == 0:
                # Vectors of the plan's width, in a loop: no slower than one vector of all the task's
                # rows, which LLVM compiled for seconds (a 128-lane vector of per-lane index arithmetic).
                inner = sch.split(inner, [None, lanes])[1]
            sch.vectorize(inner)


def _split_rows(sch: s_tir.Schedule, plan: StitchPlan) -> None:
    """Few long rows: every block's row cut into `split` chunks, one parallel loop per block.

    A reduction block (every loop inside the row reduces) gets partials per
    chunk and vector lane (rfactor over chunk x lane), computed in parallel
    over (chunk, row); the block itself then combines a row's partials. An
    element-wise block runs its chunks in parallel, vectorised. Blocks stay in their own loop nests, in
    producer order: the intermediates between them live in memory, as in
    global stitching on CUDA. A block that mixes kinds, or whose row the
    chunks do not divide, keeps its serial loops (correct, unsplit).
    """
    split, lanes, rank = plan.mapping.split, plan.mapping.vector, plan.rank
    for name in list(blocks_by_name(sch)):
        block = sch.get_sblock(name)
        kinds = loop_kinds(sch, block)
        rows = [l for l, _ in kinds[:rank]]
        within = kinds[rank:]
        if not within or len({k for _, k in within}) != 1:
            continue
        loop = sch.fuse(*[l for l, _ in within]) if len(within) > 1 else within[0][0]
        extent = loops_extent(sch, [loop])
        if extent is None or extent % split:
            continue
        width = _vector_lanes(extent // split, lanes) or 1
        chunk, step, lane = sch.split(loop, [split, None, width])
        if within[0][1] == tirx.IterVar.CommReduce:
            sch.reorder(chunk, lane, step)
            # the partials of a row adjacent (after the row axes): a vector per chunk, whatever the row count
            block = sch.rfactor(sch.fuse(chunk, lane), min(rank, len(sch.get(block).writes[0].source.shape)))
            loops = sch.get_loops(block)  # the partial's own nest: the old row loops hold the combine
            rows, chunk_lane, step = loops[:rank], loops[-2], loops[-1]
            chunk, lane = sch.split(chunk_lane, [split, width])
            sch.reorder(*rows, chunk, step, lane)
        # (row, chunk) tasks, the chunk innermost: a task's row and chunk divide by the chunk count, a constant
        parallel = sch.fuse(*rows, chunk) if rows else chunk
        if plan.mapping.threads > 1:
            sch.parallel(parallel)
        if width > 1:
            sch.vectorize(lane)


def _rows_across_lanes(sch: s_tir.Schedule, plan: StitchPlan) -> None:
    """Short rows across the vector lanes: one row loop over every block, parallel over the cores,
    every loop inside a row unrolled and none vectorised here.

    Each row is then straight-line code, and LLVM's loop vectoriser runs the
    row loop in vector lanes, a row per lane: a vector's rows loaded
    contiguously and regrouped by lane shuffles, a reduction a lane-wise max
    or sum over the row's elements, the rows past the last whole vector in a
    scalar tail (any row count, symbolic too).
    """
    row = merge_row_loops(sch, plan)
    if plan.mapping.threads > 1 and plan.mapping.rows != 1:
        sch.parallel(row)
    for block in blocks_by_name(sch).values():
        spatial, reduce = within_row_loops(sch, block, row)
        for loop in spatial + reduce:
            sch.unroll(loop)


def _merge_nests(sch: s_tir.Schedule, names: list) -> None:
    """Merge the blocks' outer loops; deeper levels too while extents agree and the blocks are independent."""
    levels = min(len(sch.get_loops(sch.get_sblock(n))) for n in names)
    if not _independent(sch, names):
        levels = 1
    for level in range(levels):
        loops = [sch.get_loops(sch.get_sblock(n))[level] for n in names]
        if len({loops_extent(sch, [l]) for l in loops}) != 1:
            break
        if not all(sch.get(l).same_as(sch.get(loops[0])) for l in loops):
            sch.merge(*loops)


def _independent(sch: s_tir.Schedule, names: list) -> bool:
    """No block reads a buffer another block writes."""
    blocks = [sch.get(sch.get_sblock(n)) for n in names]
    return not any(r.source.same_as(w.source) for a in blocks for b in blocks if a is not b
                   for r in a.reads for w in b.writes)


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    del target
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    if plan.mapping.across:
        _rows_across_lanes(sch, plan)
        return sch
    if plan.mapping.rows_per_task > 1 and plan.rank > 0:
        _stream_rows(sch, plan)
        return sch
    if plan.mapping.split > 1:
        _split_rows(sch, plan)
        return sch
    lanes = plan.mapping.vector
    lane_blocks = []
    if lanes > 1 and plan.rank > 0:
        for block in list(blocks_by_name(sch).values()):
            if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars):
                lane_block = _split_reduction_lanes(sch, block, plan.rank, lanes)
                if lane_block is not None:
                    lane_blocks.append(sch.get(lane_block).name_hint)
    row = merge_row_loops(sch, plan)
    if plan.mapping.threads > 1 and plan.mapping.rows != 1:
        sch.parallel(row)
    for name in lane_blocks:
        # The lane loop keeps the reduction's init attached: s_tir refuses to
        # vectorise it after decompose_reduction.
        sch.vectorize(sch.get_loops(sch.get_sblock(name))[-1])
    for block in blocks_by_name(sch).values():
        if sch.get(block).name_hint in lane_blocks:
            continue
        spatial, reduce = within_row_loops(sch, block, row)
        if reduce or not spatial:
            continue
        loop = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        extent = sch.get(loop).extent
        width = _vector_lanes(extent.value, lanes) if isinstance(extent, tirx.IntImm) else None
        if width is not None:
            _, inner = sch.split(loop, [None, width])
            sch.vectorize(inner)
    return sch
