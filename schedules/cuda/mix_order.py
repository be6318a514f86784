"""Mix-order on CUDA: row reductions and column reductions of the same rows in one pass.

Realises a "mix-order" plan (tvm_stitch.planning.cuda.mix_order). The fused
PrimFunc holds blocks over rows (row reductions, element-wise outputs of a
row: LayerNorm backward's dx) and column reductions of the same rows
(dgamma, dbeta). Kernel 0, `grid` blocks of `threads` threads, each block
owning `rows / grid` consecutive rows:

- every column reduction's rows are cut into `grid` chunks and rfactored: the
  partial block (a chunk's sum per column) accumulates in registers (`local`,
  laid out per thread: `vector` lanes of each of its column steps) under the
  row loop, and is written to a `grid x columns` buffer once per block;
- the row blocks run under the same row loop as in row-resident: reductions
  across the block's threads (TVM's all-reduce), element-wise outputs one
  `vector` of consecutive columns per thread per step.

Kernel 1 combines the partials: blocks over tiles of one 32-byte sector of
columns, `threadIdx.y` over the chunks (a cross-thread reduction). With the
plan's `combining_blocks` (CUDA), kernel 1's sums move into kernel 0's last
blocks instead (combine_in_launch: one launch). Applied
for an llvm target, the same loops run without thread bindings and in global
memory (the emulated CUDA check).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.analysis.tir_view import buffer_params
from tvm_stitch.planning.cuda.column_split import SECTOR_BYTES
from tvm_stitch.planning.plan import StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks
from .combine_in_launch import combine_in_launch
from .row_split import in_kernel_order



def combine_shape(sch: s_tir.Schedule, plan: StitchPlan) -> tuple:
    """Kernel 1's block: (columns, threads over the chunks). The columns of one 32-byte sector of a
    partial (threadIdx.x: each row of partials read in whole sectors, the most blocks over the
    columns), and the most threadIdx.y that divide the chunks within the target's threads."""
    dtype = sch.get(sch.get_sblock(plan.dominant[0])).writes[0].source.dtype
    columns = max(1, SECTOR_BYTES // (tvm.DataType(dtype).bits // 8))
    most = plan.spec.max_threads_per_block // columns
    return columns, max(d for d in range(1, min(most, plan.mapping.grid) + 1) if plan.mapping.grid % d == 0)


def _column_partials(sch: s_tir.Schedule, plan: StitchPlan, bind: bool) -> tuple:
    """Rfactor each column reduction over the row chunks: (partial blocks' names, their register
    write-back blocks' names)."""
    m = plan.mapping
    partials, write_backs = [], []
    for name in plan.dominant:
        column, rows = sch.get_loops(sch.get_sblock(name))
        chunk, _ = sch.split(rows, [m.grid, None])
        partial = sch.rfactor(chunk, 0)
        kept, chunk, row = sch.get_loops(partial)
        sch.reorder(chunk, row, kept)
        partials.append(sch.get(partial).name_hint)
        if bind:
            write_back = sch.cache_write(partial, 0, "local")
            write_backs.append(sch.get(write_back).name_hint)
            threads, lanes = m.threads, m.vector
            # Per thread: (its column steps, lanes). The block and thread indices are left out of the
            # layout (each CUDA thread has its own registers): kept in, the accesses of the partial and
            # of its write-back, under sibling threadIdx.x loops, make TVM allocate the block's whole row
            # per thread, in local memory.
            sch.transform_layout(partial, ("write", 0), lambda g, j: (j // (threads * lanes), j % lanes),
                                 assume_injective_transform=True)
    return partials, write_backs


def _merged(sch: s_tir.Schedule, names: list, level: int):
    loops = [sch.get_loops(sch.get_sblock(n))[level] for n in names]
    return loops[0] if len(loops) == 1 else sch.merge(*loops)


def _over_columns(sch: s_tir.Schedule, name: str, plan: StitchPlan, bind: bool, vectorize: bool,
                  unroll: bool = False) -> None:
    """A block's innermost (column) loop as (steps, threadIdx.x, vector lanes); `unroll`: the steps and
    lanes unrolled (a register partial's indices constant)."""
    m = plan.mapping
    steps, thread, lanes = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [None, m.threads, m.vector])
    if bind:
        sch.bind(thread, "threadIdx.x")
    if vectorize:
        sch.vectorize(lanes)
    if bind and unroll:
        sch.unroll(steps)
        if not vectorize:
            sch.unroll(lanes)


def _row_reduction(sch: s_tir.Schedule, name: str, plan: StitchPlan, bind: bool) -> None:
    """A row reduction across the block's threads (TVM's all-reduce), its result in shared memory
    (`local` for one warp, whose all-reduce leaves the result in every lane)."""
    block = sch.get_sblock(name)
    m = plan.mapping
    steps, thread, lanes = sch.split(sch.get_loops(block)[-1], [None, m.threads, m.vector])
    sch.reorder(thread, steps, lanes)
    if bind:
        sch.bind(thread, "threadIdx.x")
        scope = "local" if plan.mapping.threads <= plan.spec.warp_size else "shared"
        for index in range(len(sch.get(block).writes)):
            sch.set_scope(block, index, scope)


def _combine(sch: s_tir.Schedule, plan: StitchPlan, bind: bool) -> None:
    """Kernel 1: per column tile, `threadIdx.y` threads sum the chunks' partials of every column
    reduction (one launch for all of them: the grid and column loops merged)."""
    columns, row_threads = combine_shape(sch, plan)
    tiles = []
    for name in plan.dominant:
        column, chunks = sch.get_loops(sch.get_sblock(name))
        tile, lane = sch.split(column, [None, columns])
        outer, thread = sch.split(chunks, [None, row_threads])
        sch.reorder(tile, lane, thread, outer)
        tiles.append(tile)
    tile = tiles[0] if len(tiles) == 1 else sch.merge(*tiles)
    lane = _merged(sch, list(plan.dominant), 1)
    if bind:  # each reduction under a threadIdx.y loop of its own: the cross-thread lowering's condition
        sch.bind(tile, "blockIdx.x")
        sch.bind(lane, "threadIdx.x")
        for name in plan.dominant:
            sch.bind(sch.get_loops(sch.get_sblock(name))[2], "threadIdx.y")


STAGING_BYTES = 4096  # shared memory kept free of input copies: the all-reduces' staging, the row results


def _inputs_on_chip(sch: s_tir.Schedule, plan: StitchPlan, names: list, loops: tuple, bind: bool) -> list:
    """Each input read by several of kernel 0's blocks loaded once, every such block reading the copy:
    a (rows, columns) one per row into shared memory, a per-row scalar (rows, 1) per row into each
    thread's registers, a (columns,) one per block into shared memory where it still fits in the
    target's shared memory per block (else read from global memory, where the cache serves it).
    `loops`: (grid, row). Returns the names of the copies over columns (their loops are then cut over
    the threads)."""
    grid, row = loops
    rows, columns = plan.mapping.rows, plan.mapping.row_elements
    params = buffer_params(sch.mod["main"])
    places = {(rows, columns): (row, "local"), (rows, 1): (row, "local"), (columns,): (grid, "shared")}
    readers = {}
    for name in names:
        for index, region in enumerate(sch.get(sch.get_sblock(name)).reads):
            buffer = region.source
            shape = tuple(int(e) for e in buffer.shape)
            if shape in places and any(buffer.same_as(p) for p in params):
                readers.setdefault(buffer.name, (shape, tvm.DataType(buffer.dtype).bits // 8, []))[2].append(
                    (name, index))
    copies, room = [], plan.spec.shared_bytes_per_block - STAGING_BYTES
    for shape, nbytes, reading in sorted(readers.values(), key=lambda r: -len(r[0])):
        loop, scope = places[shape]
        size = columns * nbytes if scope == "shared" else 0
        if len(reading) < 2 or size > room:
            continue
        room -= size
        first, index = reading[0]
        copy = sch.cache_read(sch.get_sblock(first), index, scope if bind else "global",
                              consumer_blocks=[sch.get_sblock(n) for n, _ in reading])
        sch.compute_at(copy, loop, preserve_unit_loops=True)
        if shape == (rows, columns) and bind:  # the thread's own columns of the row, as the partials
            threads, lanes = plan.mapping.threads, plan.mapping.vector
            sch.transform_layout(copy, ("write", 0), lambda r, j: (j // (threads * lanes), j % lanes),
                                 assume_injective_transform=True)
        if shape != (rows, 1):
            copies.append(sch.get(copy).name_hint)
    return copies


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    bind = target.kind.name == "cuda"
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    columns = set(plan.dominant)
    epilogues = [n for n, b in blocks_by_name(sch).items() if n not in columns and len(sch.get_loops(b)) == 1]
    rows = [n for n in blocks_by_name(sch) if n not in columns and n not in epilogues]
    partials, write_backs = _column_partials(sch, plan, bind)
    for name in rows:
        sch.split(sch.get_loops(sch.get_sblock(name))[0], [plan.mapping.grid, None])
    kernel_of = {n: 0 for n in blocks_by_name(sch)}
    # The epilogues after every column reduction: `merge` moves the merged combine loops to the last
    # reduction's place, and an epilogue left before them got its whole extent in every thread when
    # moved under them (reading other threads' registers).
    kernel_of.update({n: 1 for n in columns})
    kernel_of.update({n: 2 for n in epilogues})
    sch = in_kernel_order(sch, kernel_of, {})
    grid = _merged(sch, partials + rows + write_backs, 0)
    row = _merged(sch, partials + rows, 1)
    cached = _inputs_on_chip(sch, plan, partials + rows, (grid, row), bind)
    if bind:
        sch.bind(grid, "blockIdx.x")
    reductions = {n for n in rows if any(int(v.iter_type) for v in sch.get(sch.get_sblock(n)).iter_vars)}
    for name in partials + write_backs:
        _over_columns(sch, name, plan, bind, vectorize=False, unroll=True)
    for name in cached:
        _over_columns(sch, name, plan, bind, vectorize=bind, unroll=True)
    for name in rows:
        if name in reductions:
            _row_reduction(sch, name, plan, bind)
        else:
            _over_columns(sch, name, plan, bind, vectorize=bind)
    _combine(sch, plan, bind)
    _epilogues(sch, plan, epilogues, bind)
    if bind and plan.mapping.combining_blocks:
        return s_tir.Schedule(combine_in_launch(sch.mod["main"], plan))
    return sch


def _epilogues(sch: s_tir.Schedule, plan: StitchPlan, epilogues: list, bind: bool) -> None:
    """Each element-wise epilogue of a column reduction (a cast of a half-precision sum) in the thread
    that combines the reduction's column; the reduction's result then stays in a register."""
    params = buffer_params(sch.mod["main"])
    for name in epilogues:
        read = {r.source.name for r in sch.get(sch.get_sblock(name)).reads}
        source = next(c for c in plan.dominant if sch.get(sch.get_sblock(c)).writes[0].source.name in read)
        sch.reverse_compute_at(sch.get_sblock(name), sch.get_loops(sch.get_sblock(source))[1])
        written = sch.get(sch.get_sblock(source)).writes[0].source
        if bind and not any(written.same_as(p) for p in params):
            sch.set_scope(sch.get_sblock(source), 0, "local")
