"""Row-resident regional stitching on CUDA: one thread block per row task.

Every block of the kernel runs under the merged row loop, bound to
`blockIdx.x`. Inside a row, each block's loops are split over the plan's
`threads` (`threadIdx.x`): spatial loops one element per thread per step
(consecutive threads on consecutive elements, so loads coalesce), reduction
loops as a cross-thread all-reduce (warp shuffles plus one shared staging
step, from TVM's LowerCrossThreadReduction). Intermediates the plan keeps on
chip live in shared memory; cheap ones are inlined into their consumers.

A row of symbolic length planned for its upper bound (plan.bounds) runs its
loops to the bound under a guard, with what it keeps on chip sized for the
bound (common.loops_to_bounds, regions_to_bounds).

Applied for a non-CUDA target (llvm), the same schedule is built without
thread bindings and with intermediates in ordinary memory: the loop
structure, index arithmetic and reuse of the CUDA kernel then run, and are
checked, on the CPU.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.analysis.tir_view import buffer_params
from tvm_stitch.planning.common import rows_first_in_stage
from tvm_stitch.planning.plan import REGISTER, SHARED, StitchPlan
from tvm_stitch.planning.resources import unrolled_steps

from ..common import (blocks_by_name, inline_cheap_blocks, loops_extent, loops_to_bounds, merge_row_loops,
                      regions_to_bounds, thread_factors, within_row_loops)

UNROLL = 64


def _split_over_threads(sch: s_tir.Schedule, loop, threads: int, bind: bool, plan: StitchPlan):
    outer, inner = sch.split(loop, thread_factors(sch, loop, threads, plan))
    if bind:
        sch.bind(inner, "threadIdx.y" if plan.mapping.across else "threadIdx.x")
    return outer, inner


def _cache_input_row(sch: s_tir.Schedule, buffer_name: str, scope: str) -> None:
    """Load the input once into `scope`; every block that reads it reads the copy."""
    readers = []
    for block in blocks_by_name(sch).values():
        reads = [r.source.name for r in sch.get(block).reads]
        if buffer_name in reads:
            readers.append((block, reads.index(buffer_name)))
    first, index = readers[0]
    sch.cache_read(first, index, scope, consumer_blocks=[b for b, _ in readers])


def _fused_rows(extents: list, rank: int):
    """The index map (r0, .., r{rank-1}, *rest) -> (fused row, *rest) for row extents `extents`."""
    def fused(*indices):
        row = indices[0]
        for i, extent in zip(indices[1:rank], extents[1:]):
            row = row * extent + i
        return (row, *indices[rank:])
    return fused


def _flatten_row_axes(sch: s_tir.Schedule, rank: int) -> None:
    """Give every buffer the kernel allocates one row axis: (r0, .., r{rank-1}, *rest) -> (r, *rest).

    With several rows per block, a block's rows are consecutive values of the
    fused row index, but per row axis they are not a box: 8 rows of
    (8, 12, 128) span 8 values of the last axis and, as far as TVM's region
    analysis can tell, all 12 of the middle one, so a shared buffer would be
    compacted to 96 rows where the plan pays for 8. Over the fused index the
    block's region is exactly its rows. Parameters keep their layout.
    """
    params = list(sch.mod["main"].params)
    done = set()  # names of buffers already flattened (a buffer written by several blocks)
    for block in blocks_by_name(sch).values():
        for index, region in enumerate(sch.get(block).writes):
            buffer = region.source
            extents = [int(e) for e in buffer.shape[:rank] if isinstance(e, tirx.IntImm)]
            if buffer.name in done or any(buffer.same_as(p) for p in params) or len(extents) < rank:
                continue
            done.add(buffer.name)
            index_map = tirx.IndexMap.from_func(_fused_rows(extents, rank), ndim=len(buffer.shape),
                                                index_dtype=str(buffer.shape[0].ty))
            sch.transform_layout(block, ("write", index), index_map)


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    bind = target.kind.name == "cuda"
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    _stage_on_chip(sch, plan, ("local" if plan.mapping.threads == 1 else "shared") if bind else "global")
    if plan.bounds:
        sch = s_tir.Schedule(loops_to_bounds(sch.mod["main"], plan))
    row = _bind_rows(sch, merge_row_loops(sch, plan), plan, bind)
    warp_reduced, serial_reduced = _map_within_rows(sch, row, plan, bind)
    if bind:
        _set_scopes(sch, plan, warp_reduced)
    for name, thread_loop in serial_reduced:
        # Accumulated in a register, stored to shared memory once: a sum updated in shared memory
        # under a thread predicate (a row length the threads do not divide: average pooling's
        # windows) needs barriers inside the predicate, which TVM's lowering rejects.
        stage = sch.cache_write(sch.get_sblock(name), 0, "local")
        sch.reverse_compute_at(stage, thread_loop)
    flattened = plan.mapping.rows_per_task > 1 and plan.mapping.threads > 1 and plan.rank > 1
    if flattened:
        _flatten_row_axes(sch, plan.rank)
    if bind:
        regions_to_bounds(sch, plan, ("shared", "local"), 1 if flattened else plan.rank)
    return sch


def _stage_on_chip(sch: s_tir.Schedule, plan: StitchPlan, on_chip: str) -> None:
    """Copies in `on_chip` scope of the kernel outputs kept on chip and of each cached input's row."""
    on_chip_outputs = [i.name for i in plan.intermediates if not i.inlined and i.name in plan.outputs]
    for name in on_chip_outputs:
        block = sch.get_sblock(name)
        consumers = sch.get_consumers(block)
        stage = sch.cache_write(block, 0, on_chip, consumer_blocks=consumers)
        if plan.row_axes:
            rows_first_in_stage(sch, block, stage, plan.rank)
    for name in plan.cached_inputs:
        _cache_input_row(sch, name, on_chip)


def _bind_rows(sch: s_tir.Schedule, row, plan: StitchPlan, bind: bool):
    """The row loop, split into blocks of `rows_per_task` rows where packed, bound to blocks (and
    the packed rows to threads); the loop of one row."""
    threads, packed = plan.mapping.threads, plan.mapping.rows_per_task
    if threads == 1 and plan.mapping.row_elements == 1 and plan.mapping.vector > 1:
        # Element-wise, `vector` elements per thread a block's width apart (each load coalesced),
        # unrolled: that many independent loads in flight per thread.
        block_loop, lane, row = sch.split(row, [None, plan.mapping.vector, packed])
        sch.annotate(lane, "pragma_unroll_explicit", 1)
        sch.unroll(lane)
        if bind:
            sch.bind(block_loop, "blockIdx.x")
            sch.bind(row, "threadIdx.x")
    elif packed > 1:
        block_loop, row = sch.split(row, [None, packed])
        if bind:
            sch.bind(block_loop, "blockIdx.x")
            sch.bind(row, "threadIdx.x" if threads == 1 or plan.mapping.across else "threadIdx.y")
    elif bind:
        sch.bind(row, "blockIdx.x")
    return row


def _map_within_rows(sch: s_tir.Schedule, row, plan: StitchPlan, bind: bool) -> tuple:
    """Each block's loops inside a row over the row's threads; (intermediates reduced across the
    threads of one warp or, across (column tiles), over threadIdx.y: their result is in every
    thread, (intermediate, its thread loop) of those reduced serially in each thread)."""
    threads = plan.mapping.threads
    kept_on_chip = {i.name for i in plan.intermediates if not i.inlined}
    warp_reduced, serial_reduced = [], []
    for name, block in blocks_by_name(sch).items():
        spatial, reduce = within_row_loops(sch, block, row)
        if threads == 1:
            continue  # one thread per row: the row's loops run in that thread
        spatial_extent = loops_extent(sch, spatial)
        if reduce and (spatial_extent is None or spatial_extent < threads):
            # Across (column tiles): the all-reduce over threadIdx.y leaves the result in every thread too.
            if (threads <= plan.spec.warp_size or plan.mapping.across) and name in kept_on_chip:
                warp_reduced.append(name)
            # Few outputs per row: the threads share each output's reduction.
            loop = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
            if spatial:
                sch.reorder(*spatial, loop)
            outer, inner = _split_over_threads(sch, loop, threads, bind, plan)
            sch.reorder(inner, outer)
            if bind:  # on the CPU the thread loop is serial: unrolling around it only bloats the code
                _unroll_within_registers(sch, block, outer, plan)
        elif spatial:
            # One output per thread (or `vector` consecutive ones, as one 128-bit access);
            # its reduction, if any, runs serially in the thread.
            loop = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
            lanes = plan.mapping.vector
            if not reduce and lanes > 1 and (spatial_extent or 0) % (threads * lanes) == 0:
                loop, vector_loop = sch.split(loop, [None, lanes])
                sch.vectorize(vector_loop)
            _, thread_loop = _split_over_threads(sch, loop, threads, bind, plan)
            if reduce and bind and name in kept_on_chip and name not in plan.outputs:
                serial_reduced.append((name, thread_loop))
        else:
            _split_over_threads(sch, sch.add_unit_loop(block), threads, bind, plan)
    return warp_reduced, serial_reduced


def _unroll_within_registers(sch: s_tir.Schedule, block, loop, plan: StitchPlan) -> None:
    """Unroll a thread's serial steps over a row (at most UNROLL) where the values they load from
    global memory fit the thread's registers (resources.unrolled_steps); more steps stay a loop."""
    params = buffer_params(sch.mod["main"])
    loads = {r.source.name for r in sch.get(block).reads if any(r.source.same_as(p) for p in params)}
    extent = sch.get(loop).extent
    steps = int(extent) if isinstance(extent, tirx.IntImm) else UNROLL + 1
    if steps <= unrolled_steps(plan.threads_per_block, len(loads), plan.spec):
        sch.annotate(loop, "pragma_auto_unroll_max_step", UNROLL)
        sch.annotate(loop, "pragma_unroll_explicit", 1)


def _set_scopes(sch: s_tir.Schedule, plan: StitchPlan, warp_reduced: list) -> None:
    """Each intermediate kept on chip (not an output) in the scope of its level."""
    for inter in plan.intermediates:
        if inter.inlined or inter.name in plan.outputs:
            continue
        scope = {SHARED: "shared", REGISTER: "local"}.get(inter.level)
        if scope == "shared" and inter.name in warp_reduced:
            # A one-warp all-reduce leaves its result in every thread's registers. Kept in shared
            # memory, lane 0 stores it and the other lanes read it back with no barrier between
            # (TVM's ThreadSync sees the same index on both sides): a race, found by Oclgrind.
            scope = "local"
        if scope is not None:
            # Every buffer the block writes: a tuple reduction (argmax's index and value, a norm's
            # sum and sum of squares) left one in global scope, which CUDA lowering rejects.
            block = sch.get_sblock(inter.name)
            for index in range(len(sch.get(block).writes)):
                sch.set_scope(block, index, scope)
