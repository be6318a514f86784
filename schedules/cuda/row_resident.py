"""Row-resident regional stitching on CUDA: one thread block per row task.

Every block of the kernel runs under the merged row loop, bound to
`blockIdx.x`. Inside a row, each block's loops are split over the plan's
`threads` (`threadIdx.x`): spatial loops one element per thread per step
(consecutive threads on consecutive elements, so loads coalesce), reduction
loops as a cross-thread all-reduce (warp shuffles plus one shared staging
step, from TVM's LowerCrossThreadReduction). Intermediates the plan keeps on
chip live in shared memory; cheap ones are inlined into their consumers.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.plan import SHARED, StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks, merge_row_loops, within_row_loops

UNROLL = 64


def _extent(sch, loops) -> int | None:
    total = 1
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return None
        total *= int(extent.value)
    return total


def _split_over_threads(sch: s_tir.Schedule, loop, threads: int):
    outer, inner = sch.split(loop, [None, threads])
    sch.bind(inner, "threadIdx.x")
    return outer, inner


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    del target  # the plan already carries the thread mapping for it
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    on_chip_outputs = [i.name for i in plan.intermediates if i.level == SHARED and i.name in plan.outputs]
    for name in on_chip_outputs:
        block = sch.get_sblock(name)
        consumers = sch.get_consumers(block)
        sch.cache_write(block, 0, "shared", consumer_blocks=consumers)
    row = merge_row_loops(sch, plan)
    sch.bind(row, "blockIdx.x")
    threads = plan.mapping.threads
    for block in blocks_by_name(sch).values():
        spatial, reduce = within_row_loops(sch, block, row)
        spatial_extent = _extent(sch, spatial) if spatial else 1
        if reduce and (spatial_extent is None or spatial_extent < threads):
            # Few outputs per row: the threads share each output's reduction.
            loop = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
            if spatial:
                sch.reorder(*spatial, loop)
            outer, inner = _split_over_threads(sch, loop, threads)
            sch.reorder(inner, outer)
            sch.annotate(outer, "pragma_auto_unroll_max_step", UNROLL)
            sch.annotate(outer, "pragma_unroll_explicit", 1)
        elif spatial:
            # One output per thread; its reduction, if any, runs serially in the thread.
            loop = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
            _split_over_threads(sch, loop, threads)
        else:
            _split_over_threads(sch, sch.add_unit_loop(block), threads)
    for inter in plan.intermediates:
        if inter.level == SHARED and inter.name not in plan.outputs:
            sch.set_scope(sch.get_sblock(inter.name), 0, "shared")
    return sch
