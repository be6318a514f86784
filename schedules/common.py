"""Schedule steps shared by the row-resident rules of every target."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import _ffi_api as _schedule_ffi

from tvm_stitch.analysis.size_bounds import upper_bound
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


def plan_bounds(plan: StitchPlan) -> dict:
    """The sizes' bounds a plan was made for, as `size_bounds.upper_bound` takes them."""
    return {name: (0, upper) for name, upper in plan.bounds}


def loops_to_bounds(func: tirx.PrimFunc, plan: StitchPlan) -> tirx.PrimFunc:
    """`func` with what a row holds sized for the bounds of its symbolic length (plan.bounds).

    Every loop inside a row whose extent is symbolic is capped at its bound: `min(s, C)` for a
    row length `s` of at most C is `s` for every valid size, and lets the schedule split the
    loop into static loops to C under a guard `i < min(s, C)`. Every buffer the kernel
    allocates gets the bound as its extent along those axes (indices stay below `s`, so in
    bounds), so that a row kept on chip has a static size.
    """
    if not plan.bounds:
        return func
    bounds = plan_bounds(plan)
    sch = s_tir.Schedule(func)
    capped = {}
    for block in blocks_by_name(sch).values():
        for loop in sch.get_loops(block)[plan.rank:]:
            node = sch.get(loop)
            upper = None if isinstance(node.extent, tirx.IntImm) else upper_bound(node.extent, bounds)
            if upper is not None:
                capped[node.loop_var] = tirx.min(node.extent, tirx.IntImm(str(node.extent.ty), upper))
    root = func.body.block
    resized = {}
    for buffer in root.alloc_buffers:
        shape = [dim if axis < plan.rank or isinstance(dim, tirx.IntImm) or upper_bound(dim, bounds) is None
                 else tirx.IntImm(str(dim.ty), upper_bound(dim, bounds)) for axis, dim in enumerate(buffer.shape)]
        if any(not new.same_as(old) for new, old in zip(shape, buffer.shape)):
            resized[buffer] = tirx.decl_buffer(shape, buffer.dtype, buffer.name, data=buffer.data,
                                               scope=buffer.scope(), layout=None)

    def cap(loop, mutator):
        body = mutator.mutate(loop.body)
        extent = capped.get(loop.loop_var, loop.extent)
        return tirx.For(loop.loop_var, loop.min, extent, loop.kind, body, loop.thread_binding, loop.annotations)

    return func.with_body(tvm_ffi.structural_mutate(
        func.body, [(tirx.For, cap), (tirx.Buffer, lambda buffer, _m: resized.get(buffer, buffer))]))


def thread_factors(sch: s_tir.Schedule, loop, threads: int, plan: StitchPlan) -> list:
    """Split factors of a loop over `threads`: [None, threads], or for a symbolic extent with a
    bound (see loops_to_bounds) static loops covering the bound, [ceil(bound / threads), threads]."""
    extent = sch.get(loop).extent
    upper = None if isinstance(extent, tirx.IntImm) or not plan.bounds else upper_bound(extent, plan_bounds(plan))
    return [None, threads] if upper is None else [-(-upper // threads), threads]


def regions_to_bounds(sch: s_tir.Schedule, plan: StitchPlan, scopes: tuple, row_axes: int) -> None:
    """Keep the static size loops_to_bounds gave the buffers of `scopes` when TVM compacts them.

    A row's accesses under the guard span `min(s, C)`, which TVM's buffer compaction would
    allocate (symbolic, which CUDA cannot); each reader's region is declared the whole row
    (a superset of what it reads: compaction takes a load's declared region, never a
    store's), so the buffer compacts to the C elements of a row. `row_axes`: the buffers' leading
    axes that index rows (plan.rank, or 1 once packed rows are flattened into one axis).
    """
    if not plan.bounds:
        return
    for block in blocks_by_name(sch).values():
        for index, region in enumerate(sch.get(block).reads):
            buffer = region.source
            if buffer.scope() not in scopes:
                continue
            ranges, widened = [], False
            for axis, (dim, rng) in enumerate(zip(buffer.shape, region.region)):
                if axis >= row_axes and isinstance(dim, tirx.IntImm):
                    ranges.append((tirx.IntImm(str(dim.ty), 0), dim))
                    widened = True
                else:
                    ranges.append((rng.min, rng.min + rng.extent))
            if widened:
                _declare_read_region(sch, block, index, ranges)


def _declare_read_region(sch: s_tir.Schedule, block, index: int, ranges: list) -> None:
    """`Schedule.annotate_buffer_access` for a read whose buffer has another rank than the block's
    iterators (its Python wrapper insists on one range per iterator): the same primitive, with the
    index map built here, block iterators -> (begin, end) per buffer axis."""
    iter_vars = [iv.var for iv in sch.get(block).iter_vars]
    final = [bound for begin_end in ranges for bound in begin_end]
    index_map = tirx.IndexMap(initial_indices=iter_vars, final_indices=final, inverse_index_map=None)
    _schedule_ffi.ScheduleAnnotateBufferAccess(sch, block, index, 0, index_map)  # 0: a read
