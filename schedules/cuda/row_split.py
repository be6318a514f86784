"""Row-split global stitching on CUDA: few long rows, one thread block per (row, chunk).

Realises a "row-split" plan (tvm_stitch/planning/row_split.py). Every reduction
is split into `split` chunks and rfactored: its partials are computed in the
reduction's kernel, one block per (row, chunk), as a cross-thread reduction.
The combine of the partials (`split` values per row) joins the kernel of
its first reader, outside the thread loops, so every thread combines them
itself, in a register; a copy goes to global memory when a later kernel or
the caller reads it. Element-wise outputs are cut into the same chunks, with
128-bit vector accesses where the chunk allows; per-row outputs (one value
per row) are computed by every thread, like combines. Each kernel is one merged
row loop (`blockIdx.y`, or `blockIdx.x` when rows are not split) holding
its blocks' chunk loops (`blockIdx.x`) and thread loops (`threadIdx.x`).
A plan with one thread per row (column walks) splits the row loop over
threads instead and walks each chunk serially in its thread.

An online (sum, max) pair of the plan (softmax's sum of exp(x - max)) is
rewritten after rfactor: the sum's partials read the chunk's partial max
instead of the row's combined max, so they run in the max's kernel, and the
sum's combine rescales each partial by exp(m_c - M).

Applied for an llvm target, the same loops run without thread bindings, so
the index arithmetic and the combine order are checked on the CPU.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.planning.common import recompute_in_readers
from tvm_stitch.planning.plan import GLOBAL, PhaseRole, StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks, loop_kinds, loops_extent
from .last_block_rows import finish_in_last_block


def _fuse(sch: s_tir.Schedule, loops: list):
    return loops[0] if len(loops) == 1 else sch.fuse(*loops)


def _split_reduction(sch: s_tir.Schedule, block, rank: int, split: int):
    """rfactor the block's reduction into `split` chunks; returns the partial (rf) block."""
    reduce = [loop for loop, kind in loop_kinds(sch, block)[rank:] if kind == tirx.IterVar.CommReduce]
    chunks, _ = sch.split(_fuse(sch, reduce), [split, None])
    return sch.rfactor(chunks, rank)


def _row_loop(sch: s_tir.Schedule, block, rank: int):
    return _fuse(sch, sch.get_loops(block)[:rank])


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    bind = target.kind.name == "cuda"
    columns = plan.mapping.threads == 1
    compute_level = plan.phase_kernels(PhaseRole.COMPUTE)
    combine_level = plan.phase_kernels(PhaseRole.COMBINE)
    # The kernel each block runs in: a reduction's block (after rfactor, its combine) in its
    # combine's kernel, its partials in the reduction's own.
    kernel_of = {**compute_level, **combine_level}
    sch = s_tir.Schedule(func)
    recompute_in_readers(sch, plan.recomputed_outputs)
    inline_cheap_blocks(sch, plan)
    chunked, partial_of = _chunked(sch, plan, kernel_of, compute_level, combine_level)

    # Root loop nests in kernel order, then each kernel's row loops merged into one.
    rewrites = _online_rewrites(sch, plan.online, partial_of)
    rewrites.update(_variance_rewrites(sch, plan.variance, partial_of, plan.mapping.split))
    sch = in_kernel_order(sch, kernel_of, rewrites)
    if bind and not columns:
        for total, peak in plan.online + tuple((squares, total) for squares, total in plan.variance):
            # The chunk max feeds the chunk's sum through shared memory: only thread 0 writes the
            # global partial, and without a barrier the block's other threads may read it early.
            # Its copy to global memory, per chunk, keeps the partial for the combine.
            chunk_max = sch.get_sblock(partial_of[peak])
            copy = sch.cache_write(chunk_max, 0, "shared", consumer_blocks=[sch.get_sblock(partial_of[total])])
            sch.reverse_compute_at(copy, sch.get_loops(chunk_max)[-2])
    rows = _bind_kernel_rows(sch, plan, kernel_of, bind)
    _bind_chunks(sch, plan, chunked, bind)
    if bind:
        global_combines = {i.name for i in plan.intermediates if i.level == GLOBAL}
        for name, lvl in combine_level.items():
            block = sch.get_sblock(name)
            if name in global_combines:
                # Accumulate in a register; the copy to global memory writes the final value only.
                readers = [c for c in sch.get_consumers(block) if kernel_of[sch.get(c).name_hint] == lvl]
                copy = sch.cache_write(block, 0, "local", consumer_blocks=readers)
                sch.reverse_compute_at(copy, rows[lvl])
            else:
                sch.set_scope(block, 0, "local")
        if plan.mapping.last_block_rows:
            return s_tir.Schedule(finish_in_last_block(sch.mod["main"], plan))
    return sch


def _chunked(sch: s_tir.Schedule, plan: StitchPlan, kernel_of: dict, compute_level: dict,
             combine_level: dict) -> tuple:
    """Every block's row cut into `split` chunks, a reduction's as partials (rfactor) whose kernel
    `kernel_of` gets; ((block name, is a partial reduction) of each chunked block, reduction -> its
    partial block)."""
    rank, split = plan.rank, plan.mapping.split
    chunked, partial_of = [], {}
    for name, block in blocks_by_name(sch).items():
        if name in combine_level:
            partial = sch.get(_split_reduction(sch, block, rank, split)).name_hint
            kernel_of[partial] = compute_level[name]
            chunked.append((partial, True))
            partial_of[name] = partial
        elif loops_extent(sch, sch.get_loops(block)[rank:]) != 1:
            within = sch.get_loops(block)[rank:]
            sch.split(_fuse(sch, within), [split, None])
            chunked.append((name, False))
    return chunked, partial_of


def _bind_kernel_rows(sch: s_tir.Schedule, plan: StitchPlan, kernel_of: dict, bind: bool) -> list:
    """Each kernel's row loops merged into one, bound to blocks (column walks: rows across the
    threads of a block); the row loop of each kernel."""
    kernels = [[] for _ in range(plan.phase_count)]
    for name, block in blocks_by_name(sch).items():
        if name in kernel_of:  # not a copy placed inside another block's loops
            kernels[kernel_of[name]].append(_row_loop(sch, block, plan.rank))
    rows = [loops[0] if len(loops) == 1 else sch.merge(*loops) for loops in kernels]
    row_block = "blockIdx.y" if plan.mapping.split > 1 else "blockIdx.x"
    if plan.mapping.threads == 1:
        # A thread per row (column walk): rows across the threads of a block.
        anchors = []
        for row in rows:
            outer, inner = sch.split(row, [None, plan.mapping.rows_per_task])
            if bind:
                sch.bind(outer, row_block)
                sch.bind(inner, "threadIdx.x")
            anchors.append(inner)
        return anchors
    if bind:
        for row in rows:
            sch.bind(row, row_block)
    return rows


def _bind_chunks(sch: s_tir.Schedule, plan: StitchPlan, chunked: list, bind: bool) -> None:
    """Each chunk over blocks, its elements over the block's threads (in vector lanes where the
    plan has them; a column walk's chunk serially in its thread)."""
    split, threads, vector = plan.mapping.split, plan.mapping.threads, plan.mapping.vector
    for name, partial in chunked:
        loops = sch.get_loops(sch.get_sblock(name))
        chunk_loop, inner = loops[-2], loops[-1]
        if bind and split > 1:
            sch.bind(chunk_loop, "blockIdx.x")
        if threads == 1:
            continue  # the thread walks its chunk of the column serially
        if partial:
            outer, thread = sch.split(inner, [None, threads])
            sch.reorder(thread, outer)
        elif vector > 1:
            _, thread, lanes = sch.split(inner, [None, threads, vector])
            sch.vectorize(lanes)
        else:
            _, thread = sch.split(inner, [None, threads])
        if bind:
            sch.bind(thread, "threadIdx.x")


def _with_reads(block, body, loads: list):
    """`block` with `body`: its reads of buffers the body no longer loads dropped, the points
    `loads` added."""
    loaded = []
    tvm_ffi.structural_walk(body, (tvm.ir.TensorLoad, lambda load: loaded.append(load.source)), order="post")
    kept = [r for r in block.reads if any(r.source.same_as(b) for b in loaded)]
    extra = [tirx.BufferRegion(load.source, [tvm.ir.Range.from_min_extent(i, 1) for i in load.indices])
             for load in loads]
    return s_tir.SBlock(block.iter_vars, kept + extra, block.writes, block.name_hint, body, block.init,
                        block.alloc_buffers, block.match_buffers, block.annotations)


def _online_rewrites(sch: s_tir.Schedule, online: tuple, partial_of: dict) -> dict:
    """Block name -> rewritten block, for each online (sum, max) pair: the sum's partial reads the
    max's partial of its own chunk in place of the combined max; the sum's combine adds each
    partial times exp(m_c - M)."""
    rewrites = {}
    for total, peak in online:
        sum_rf, max_rf = (sch.get(sch.get_sblock(partial_of[n])) for n in (total, peak))
        combined = sch.get(sch.get_sblock(peak)).body.buffer
        chunk_max = tirx.BufferLoad(max_rf.body.buffer, list(sum_rf.body.indices))

        def own_chunk(load, combined=combined, chunk_max=chunk_max):
            return chunk_max if load.source.same_as(combined) else load

        body = tvm_ffi.structural_map(sum_rf.body, (tvm.ir.TensorLoad, own_chunk))
        rewrites[sum_rf.name_hint] = _with_reads(sum_rf, body, [chunk_max])
        block = sch.get(sch.get_sblock(total))
        store = block.body  # total = total + total_rf[.., c, ..]
        partial = store.value.b
        peak_at = tirx.BufferLoad(max_rf.body.buffer, list(partial.indices))
        row_max = tirx.BufferLoad(combined, list(store.indices))
        shift = peak_at - row_max
        if str(shift.ty) != str(partial.ty):  # float16 maxima, float32 sums
            shift = tirx.Cast(str(partial.ty), shift)
        value = store.value.a + partial * tirx.exp(shift)
        rewrites[block.name_hint] = _with_reads(block, tirx.BufferStore(store.buffer, value, store.indices),
                                                [peak_at, row_max])
    return rewrites


def _variance_rewrites(sch: s_tir.Schedule, variance: tuple, partial_of: dict, split: int) -> dict:
    """Block name -> rewritten block, for each one-pass (squared deviations, sum) pair: the
    squares' partial shifts by its chunk's own sum (the combined sum S replaced by s_c * split);
    the squares' combine adds q_c + d * (2 * (s_c - n_c * m_c) + n_c * d), d = m_c - M, in the sums' dtype
    (a half-precision shift widened: the squares were rounded in half precision, the identity is not)."""
    rewrites = {}
    for squares, total in variance:
        sq_rf, sum_rf = (sch.get(sch.get_sblock(partial_of[n])) for n in (squares, total))
        combined = sch.get(sch.get_sblock(total)).body.buffer
        dtype = str(sum_rf.body.buffer.dtype)
        chunk = 1  # n_c: the elements of a chunk, reduced inside the partial
        for iv in sq_rf.iter_vars:
            if iv.iter_type == tirx.IterVar.CommReduce:
                chunk *= int(iv.dom.extent)

        def with_sum(expr, value, combined=combined):
            return tvm_ffi.structural_map(expr, (tvm.ir.TensorLoad,
                                                 lambda load: value if load.source.same_as(combined) else load))

        own_sum = tirx.BufferLoad(sum_rf.body.buffer, list(sq_rf.body.indices))
        scale = tirx.const(split, dtype)
        rewrites[sq_rf.name_hint] = _with_reads(sq_rf, with_sum(sq_rf.body, own_sum * scale), [own_sum])
        shift = _uncast(sq_rf.body.value.b).a.b  # (a - m) * (a - m): m, reading only S (planning checked)
        block = sch.get(sch.get_sblock(squares))
        store = block.body  # q = q + q_rf[.., c]
        partial = store.value.b
        chunk_sum = tirx.BufferLoad(sum_rf.body.buffer, list(partial.indices))
        row_sum = tirx.BufferLoad(combined, list(store.indices))
        chunk_shift, row_shift = (_as(dtype, with_sum(shift, value)) for value in (chunk_sum * scale, row_sum))
        n_c = tirx.const(chunk, dtype)
        d = chunk_shift - row_shift
        value = store.value.a + (partial + d * (tirx.const(2, dtype) * (chunk_sum - n_c * chunk_shift) + n_c * d))
        rewrites[block.name_hint] = _with_reads(block, tirx.BufferStore(store.buffer, value, store.indices),
                                                [chunk_sum, row_sum])
    return rewrites


def _uncast(expr):
    """`expr` without the float casts around it (half-precision squares summed in float32)."""
    while isinstance(expr, tirx.Cast) and str(expr.ty).startswith("float"):
        expr = expr.value
    return expr


def _as(dtype: str, expr):
    """`expr` cast to `dtype` where it has another."""
    return expr if str(expr.ty) == dtype else tirx.Cast(dtype, expr)


def in_kernel_order(sch: s_tir.Schedule, kernel_of: dict, rewrites: dict) -> s_tir.Schedule:
    """A schedule of the same function with its root loop nests stably sorted by kernel, and the
    blocks of `rewrites` (name -> block) replaced.

    A valid order: every value flows from a kernel to a later one (a combine
    follows its partial; readers are in the combine's kernel or later).
    `sch.merge` moves merged loops to the last one's place without checking
    dependences, so each kernel's loops must be adjacent before merging.
    """
    func = sch.mod["main"]
    realize = func.body
    root = realize.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]

    def block_name(stmt) -> str:
        while isinstance(stmt, tirx.For):
            stmt = stmt.body
        return stmt.block.name_hint

    ordered = sorted(nests, key=lambda nest: kernel_of[block_name(nest)])
    ordered = [tvm_ffi.structural_map(nest, (s_tir.SBlock, lambda b: rewrites.get(b.name_hint, b)))
               for nest in ordered]
    body = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, tirx.SeqStmt(ordered), root.init,
                        root.alloc_buffers, root.match_buffers, root.annotations)
    return s_tir.Schedule(func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, body)))

