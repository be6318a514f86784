"""Column-split on CUDA: column reductions over blocks of (columns x rows) threads.

Realises a "column-split" plan (tvm_stitch.planning.cuda.column_split.py). Per
reduction block, with its kept (spatial) loops fused into one and its
reduced loops fused into one:

- with `split > 1` the reduced loop is cut into `split` chunks and rfactored:
  the partial block (one value per chunk and column, in global memory) runs
  in kernel 0, the original block combines the chunks in kernel 1;
- the (chunk's) reduced loop is cut by `threads_y` (plan.mapping.rows_per_task)
  and rfactored again: each thread accumulates every `threads_y`-th row
  of its columns in registers (`vector` lanes, one 128-bit load per row where
  the plan says), and the block reduces its `threads_y` sums per column over
  `threadIdx.y` (TVM's cross-thread reduction, in shared memory);
- the kept loop is split into (column tile -> blockIdx.x, `threadIdx.x`,
  vector lanes).

Every kernel's blocks share one grid loop (merged). An element-wise output
of a reduction (a mean's divide) is placed at the point its reduction's
result is written, in the same thread; the result then stays in a register
unless it is itself an output. Applied for an llvm target, the same loops run
without thread bindings (the emulated CUDA check).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.planning.cuda.column_split import COMBINE_THREADS
from tvm_stitch.planning.plan import StitchPlan

from ..common import blocks_by_name, inline_cheap_blocks
from .row_split import in_kernel_order


def _fuse(sch: s_tir.Schedule, loops: list):
    return loops[0] if len(loops) == 1 else sch.fuse(*loops)


def _over_threads(sch: s_tir.Schedule, block, plan: StitchPlan, chunked: bool) -> tuple:
    """Cut `block`'s (chunk's) reduced loop over threadIdx.y and rfactor it: (the per-thread block,
    loops (chunk?, tile, ty, tx, rows, lanes); `block`, loops (chunk?, tile, tx, lanes, ty))."""
    m = plan.mapping
    lead = 1 if chunked else 0
    _, ty = sch.split(sch.get_loops(block)[-1], [None, m.rows_per_task])
    per_thread = sch.rfactor(ty, 0)
    inner = sch.get_loops(per_thread)
    tile, tx, lanes = sch.split(inner[lead], [None, m.threads, m.vector])
    sch.reorder(tile, inner[-1], tx, inner[-2], lanes)
    outer = sch.get_loops(block)
    tile2, tx2, lanes2 = sch.split(outer[lead], [None, m.threads, m.vector])
    sch.reorder(tile2, tx2, lanes2, outer[-1])
    return per_thread, block


def _partials(sch: s_tir.Schedule, plan: StitchPlan) -> tuple:
    """Per reduction: kept loops fused (a unit loop for a whole tensor), reduced loops fused, cut into
    chunks (split > 1) and over the row threads. Returns ({block: kernel}, per-thread blocks,
    cross-thread blocks)."""
    kernel_of, per_thread, reduced = {}, [], []
    for name in plan.dominant:
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        if plan.rank:
            _fuse(sch, loops[:plan.rank])
        else:  # a whole-tensor reduction: a unit loop stands for the kept axis
            sch.add_unit_loop(loops[0])
        _fuse(sch, sch.get_loops(block)[1:])
        target_block = block
        if plan.mapping.split > 1:
            chunk, _ = sch.split(sch.get_loops(block)[1], [plan.mapping.split, None])
            target_block = sch.rfactor(chunk, 0)
            sch.reorder(sch.get_loops(target_block)[1], sch.get_loops(target_block)[0])
            kernel_of[name] = 1
        thread_block, reducing = _over_threads(sch, target_block, plan, plan.mapping.split > 1)
        for b in (thread_block, reducing):
            kernel_of[sch.get(b).name_hint] = 0
        per_thread.append(sch.get(thread_block).name_hint)
        reduced.append(sch.get(reducing).name_hint)
    return kernel_of, per_thread, reduced


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    bind = target.kind.name == "cuda"
    chunked = plan.mapping.split > 1
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    for block in blocks_by_name(sch).values():
        if not sch.get_loops(block):  # a scalar epilogue: rfactor's rewrite needs a loop above it
            sch.add_unit_loop(block)
    kernel_of, per_thread, reduced = _partials(sch, plan)
    epilogues = {n: _source(sch, n, set(plan.dominant)) for n in blocks_by_name(sch) if n not in kernel_of}
    kernel_of.update({n: plan.kernels - 1 for n in epilogues})
    sch = in_kernel_order(sch, kernel_of, {})
    _grid(sch, per_thread + reduced, chunked, bind)
    for name in per_thread:
        loops = sch.get_loops(sch.get_sblock(name))
        if bind:
            sch.bind(loops[-4], "threadIdx.y")
            sch.bind(loops[-3], "threadIdx.x")
            sch.set_scope(sch.get_sblock(name), 0, "local")
        sch.vectorize(loops[-1])
    for name in reduced:
        loops = sch.get_loops(sch.get_sblock(name))
        if bind:
            sch.bind(loops[-1], "threadIdx.y")
            sch.bind(loops[-3], "threadIdx.x")
    if chunked:
        _combine(sch, plan, bind)
    _epilogues(sch, plan, epilogues, chunked, bind)
    return sch


def _source(sch: s_tir.Schedule, name: str, reductions: set) -> str:
    """The reduction whose result the epilogue block `name` reads."""
    written = {sch.get(sch.get_sblock(r)).writes[0].source.name: r for r in reductions}
    return next(written[r.source.name] for r in sch.get(sch.get_sblock(name)).reads if r.source.name in written)


def _grid(sch: s_tir.Schedule, names: list, chunked: bool, bind: bool) -> None:
    """Merge the grid loops (chunk, column tile) of kernel 0's blocks and bind them."""
    levels = 2 if chunked else 1
    for level in range(levels):
        loops = [sch.get_loops(sch.get_sblock(n))[level] for n in names]
        unique = []
        for loop in loops:
            if not any(sch.get(loop).same_as(sch.get(u)) for u in unique):
                unique.append(loop)
        merged = unique[0] if len(unique) == 1 else sch.merge(*unique)
        if bind:
            sch.bind(merged, "blockIdx.y" if chunked and level == 0 else "blockIdx.x")


def _combine(sch: s_tir.Schedule, plan: StitchPlan, bind: bool) -> None:
    """Kernel 1: a thread per column sums the `split` partials of each reduction; a whole-tensor
    reduction's partials are summed across the threads of one block."""
    blocks, threads = [], []
    for name in plan.dominant:
        column, chunks = sch.get_loops(sch.get_sblock(name))
        if bind and not plan.rank:
            sch.bind(chunks, "threadIdx.x")
        extent = int(sch.get(column).extent)
        blocks_loop, thread = sch.split(column, [None, min(COMBINE_THREADS, extent)])
        blocks.append(blocks_loop)
        threads.append(thread)
    grid = blocks[0] if len(blocks) == 1 else sch.merge(*blocks)
    if len(threads) > 1:
        threads = [sch.merge(*[sch.get_loops(sch.get_sblock(n))[1] for n in plan.dominant])]
    if bind:
        sch.bind(grid, "blockIdx.x")
        sch.bind(threads[0], "threadIdx.x" if plan.rank else "threadIdx.y")


def _epilogues(sch: s_tir.Schedule, plan: StitchPlan, epilogues: dict, chunked: bool, bind: bool) -> None:
    """Each element-wise output at the point its reduction's result is written, in that thread."""
    outputs = set(plan.outputs)
    for name, source in epilogues.items():
        block = sch.get_sblock(source)
        loops = sch.get_loops(block)
        sch.reverse_compute_at(sch.get_sblock(name), loops[1] if chunked else loops[-2])
    if not bind:
        return
    for source in set(epilogues.values()) - outputs:
        sch.set_scope(sch.get_sblock(source), 0, "local")
