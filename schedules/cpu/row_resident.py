"""Row-resident stitching on the CPU: row tasks in parallel over cores.

The same plan as on CUDA: every block runs under the merged row loop, which
is parallel across cores; each row's intermediates are computed once into a
per-row buffer (TVM compacts the allocation to one row) that stays in cache,
and cheap ones are inlined. Element-wise loops inside a row are vectorised
by the plan's lane count where the row length allows.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.plan import StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks, merge_row_loops, within_row_loops


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
    loop = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm) or extent.value % lanes or extent.value < 2 * lanes:
        return None
    _, lane = sch.split(loop, [None, lanes])
    return sch.rfactor(lane, 0)


def _unit(sch: s_tir.Schedule, loop) -> bool:
    extent = sch.get(loop).extent
    return isinstance(extent, tirx.IntImm) and extent.value == 1


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    del target
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
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
        if lanes > 1 and isinstance(extent, tirx.IntImm) and extent.value % lanes == 0:
            _, inner = sch.split(loop, [None, lanes])
            sch.vectorize(inner)
    return sch
