"""A mix-order kernel's combine moved into its first launch, behind the arrival counters.

The mix-order schedule (schedules/cuda/mix_order) makes two CUDA kernels:
kernel 0 writes each block's column partials (grid x columns, float32),
kernel 1 sums them per column (a cast epilogue for a half-precision output).
With `combining_blocks` k (plan.mapping), kernel 1's loops are dropped and
the same sums run at the end of kernel 0 (schedules/cuda/arrivals' protocol):

- every block, its partials written, fences, takes a ticket at slot 0;
- the blocks whose tickets are the last k wait for every arrival, then each
  sums its share of the column tiles (`lanes` columns each, tile
  `share + j * k`): a block's threads cut into `lanes` columns x `threads /
  lanes` chunk threads, each adding its chunks' partials in a register, the
  chunk threads folded in shared memory, the `lanes` first threads storing
  the column's result (cast to the output's dtype where kernel 1 cast it);
- with k = 1 the combining block resets slot 0; with more, each takes a
  departure ticket at slot 1, and the last resets both.

The combining branch is marked with the attribute COMBINING_ATTR (its value
k): the geometry reader prices it as k blocks that run after the others
(pricing/kernel_geometry). The moved code is written as TVMScript for the
shapes of the plan and spliced into kernel 0's block loop; the partials and
outputs are the scheduled function's buffers. The same bytes move as with two
launches: those the moved code and the partials' write-backs access are recorded
on the function (MOVED_TRAFFIC) for the traffic model, which sees blocks only.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from tvm_stitch.analysis.tir_view import buffer_params
from tvm_stitch.planning.cuda.combine_tiles import PARTIAL_DTYPE, combine_tiles, partial_vector, tile_threads
from tvm_stitch.planning.plan import StitchPlan

from . import arrivals

COMBINING_ATTR = "tvm_stitch.combining_blocks"
MOVED_TRAFFIC = "tvm_stitch.moved_traffic"  # (loaded, stored) bytes the traffic model adds (_moved_traffic)


class CombineShapeError(ValueError):
    """Kernel 1 is not the partials' sums this rewrite moves (the plan keeps two launches)."""

def _kernel_loops(body) -> list:
    """The outermost loops bound to blockIdx.x under the root block, in order (one per kernel)."""
    stmts = body.seq if isinstance(body, tirx.SeqStmt) else [body]
    return [s for s in stmts if isinstance(s, tirx.For) and s.thread_binding is not None
            and s.thread_binding.thread_tag == "blockIdx.x"]


def _sums(combine_loop, plan: StitchPlan) -> list:
    """(partials buffer, output buffer, output dtype) of each column reduction kernel 1 sums: the
    reduction's own result where it is an output, else the cast epilogue that reads it."""
    blocks = {}

    def visit(node):
        if isinstance(node, s_tir.SBlock):
            blocks[node.name_hint] = node

    tvm_ffi.structural_walk(combine_loop, (s_tir.SBlock, visit), order="pre")
    sums = []
    for name in plan.dominant:
        block = blocks[name]
        result = block.writes[0].source
        partials = next(r.source for r in block.reads if not r.source.same_as(result))
        store = block.body
        if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, tirx.Add)
                and str(partials.dtype) == PARTIAL_DTYPE):
            raise CombineShapeError(f"{name} is not a sum of float32 partials")
        readers = [b for b in blocks.values() if b.name_hint != name
                   and any(r.source.same_as(result) for r in b.reads)]
        if not readers:
            sums.append((partials, result, str(result.dtype)))
            continue
        epilogue = readers[0].body
        if len(readers) > 1 or not isinstance(epilogue.value, tirx.Cast) or len(readers[0].reads) != 1:
            raise CombineShapeError(f"{readers[0].name_hint} is not a cast of one reduction")
        sums.append((partials, epilogue.buffer, str(epilogue.value.ty)))
    return sums


def _folds(chunks: int) -> list:
    """(threads that add, distance) of each step folding `chunks` values into one."""
    steps = []
    while chunks > 1:
        half = (chunks + 1) // 2
        steps.append((chunks - half, half))
        chunks = half
    return steps


UNROLL_STEPS = 32  # a combining thread's partial loads of one tile unrolled up to this many (in flight at once)


def _source(plan: StitchPlan, sums: list, k: int) -> str:
    """TVMScript of the protocol and combine, over parameters p<i> (partials) and o<i> (outputs)."""
    m = plan.mapping
    grid, threads, columns = m.grid, m.threads, m.row_elements
    across, vector = tile_threads(plan), partial_vector(plan.spec)
    chunks = threads // across
    steps = -(-grid // chunks)
    params = ", ".join(f"p{i}: T.Buffer(({grid}, {columns}), '{PARTIAL_DTYPE}'), o{i}: T.Buffer(({columns},), "
                       f"'{dtype}')" for i, (_, _, dtype) in enumerate(sums))
    column = f"(mine[0] - {grid - k} + j * {k}) * {across * vector} + t % {across} * {vector} + v"
    lines = [
        "@T.prim_func",
        f"def combine({params}):",
        "    T.func_attr({'tirx.noalias': True, 'tirx.is_scheduled': True})",
        f"    for b in T.thread_binding({grid}, thread='blockIdx.x'):",
        "        turn = T.decl_buffer((1,), 'int32', scope='shared')",
        f"        red = T.decl_buffer(({threads * vector},), 'float32', scope='shared')",
        f"        for t in T.thread_binding({threads}, thread='threadIdx.x'):",
        "            mine = T.decl_buffer((1,), 'int32', scope='local')",
        f"            acc = T.decl_buffer(({vector},), 'float32', scope='local')",
        "            T.evaluate(arrivals.fence())",
        "            T.tvm_storage_sync('shared')",
        "            if t == 0:",
        "                turn[0] = arrivals.ticket(0)",
        "            T.tvm_storage_sync('shared')",
        "            mine[0] = turn[0]",
        f"            with T.attr(0, '{COMBINING_ATTR}', {k}):",
        f"                if mine[0] >= {grid - k}:",
        f"                    T.evaluate(arrivals.await_arrivals(0, {grid}))",
        f"                    for j in range({combine_tiles(plan) // k}):",
    ]
    pad = " " * 24
    loop = "T.unroll" if steps <= UNROLL_STEPS else "range"
    guard = [f"    if i * {chunks} + t // {across} < {grid}:"] if grid % chunks else []
    inner = "    " * (1 + len(guard))
    for i, (_, _, dtype) in enumerate(sums):
        lines += [
            f"{pad}for v in T.vectorized({vector}):",
            f"{pad}    acc[v] = T.float32(0)",
            f"{pad}for i in {loop}({steps}):",
            *[pad + g for g in guard],
            f"{pad}{inner}for v in T.vectorized({vector}):",
            f"{pad}{inner}    acc[v] = acc[v] + p{i}[i * {chunks} + t // {across}, {column}]",
            f"{pad}for v in T.vectorized({vector}):",
            f"{pad}    red[t * {vector} + v] = acc[v]",
            f"{pad}T.tvm_storage_sync('shared')",
        ]
        for adding, distance in _folds(chunks):
            lines += [f"{pad}if t // {across} < {adding}:",
                      f"{pad}    for v in T.vectorized({vector}):",
                      f"{pad}        red[t * {vector} + v] = red[t * {vector} + v] + red[(t + {distance * across}) * {vector} + v]",
                      f"{pad}T.tvm_storage_sync('shared')"]
        value = f"red[t * {vector} + v]"
        value = value if dtype == PARTIAL_DTYPE else f"T.Cast('{dtype}', {value})"
        lines += [f"{pad}if t < {across}:", f"{pad}    for v in T.vectorized({vector}):",
                  f"{pad}        o{i}[{column}] = {value}", f"{pad}T.tvm_storage_sync('shared')"]
    lines += _departure(k)
    return "\n".join(lines) + "\n"


def _departure(k: int) -> list:
    pad = " " * 20
    if k == 1:
        return [f"{pad}if t == 0:", f"{pad}    T.evaluate(arrivals.reset(0))"]
    return [f"{pad}if t == 0:", f"{pad}    if arrivals.ticket(1) == {k - 1}:",
            f"{pad}        T.evaluate(arrivals.reset(0))", f"{pad}        T.evaluate(arrivals.reset(1))"]


def combine_in_launch(func: tirx.PrimFunc, plan: StitchPlan) -> tirx.PrimFunc:
    """`func` (the mix-order schedule's two kernels, bound for CUDA) with kernel 1's sums run by the
    last `plan.mapping.combining_blocks` blocks of kernel 0; CombineShapeError where its shape is not the
    one this rewrite knows (the plan then keeps two launches)."""
    k = plan.mapping.combining_blocks
    root = func.body.block
    kernels = _kernel_loops(root.body)
    if len(kernels) != 2 or not combine_tiles(plan) or combine_tiles(plan) % k:
        raise CombineShapeError(f"{len(kernels)} kernels, {combine_tiles(plan)} tiles over {k} blocks")
    sums = _sums(kernels[1], plan)
    template = tvm.script.from_source(_source(plan, sums, k), extra_vars={"T": T, "arrivals": arrivals})
    buffers = dict(zip(buffer_params(template), [x for s in sums for x in s[:2]]))
    moved = tvm_ffi.structural_mutate(template.body.body, [(tirx.Buffer, lambda b, _m: buffers.get(b, b))])
    first = kernels[0]
    kernel = tirx.For(first.loop_var, first.min, first.extent, first.kind, tirx.SeqStmt([first.body, moved]),
                      first.thread_binding, first.annotations)
    # The partials stay allocated outside the kernel (device workspace the host allocates): placed by
    # TVM at the common scope of their uses, now all inside the one kernel, they would be a global
    # allocation in device code, which CUDA cannot make.
    partials = [s[0] for s in sums]
    stmts = [tirx.AllocBuffer(p) for p in partials]
    stmts += [kernel if s.same_as(first) else s for s in root.body.seq if not s.same_as(kernels[1])]
    used = _used_buffers(tirx.SeqStmt(stmts))
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, tirx.SeqStmt(stmts), root.init,
                         [a for a in root.alloc_buffers if any(a.same_as(u) for u in used)
                          and not any(a.same_as(p) for p in partials)],
                         root.match_buffers, root.annotations)
    rewritten = func.with_body(s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, block))
    return rewritten.with_attr(MOVED_TRAFFIC, _moved_traffic(sums))


def _moved_traffic(sums: list) -> list:
    """(loaded, stored) bytes of what the traffic model no longer sees as blocks: the partials written
    (kernel 0's write-backs, into a buffer no longer a root allocation) and read back, the outputs."""
    loaded = stored = 0
    for partials, output, _ in sums:
        size = 1
        for dim in partials.shape:
            size *= int(dim)
        loaded += size * tvm.DataType(partials.dtype).bits // 8
        stored += size * tvm.DataType(partials.dtype).bits // 8
        stored += int(output.shape[0]) * tvm.DataType(output.dtype).bits // 8
    return [loaded, stored]


def _used_buffers(stmt) -> list:
    found = []

    def visit(node):
        found.append(node.buffer if isinstance(node, tirx.BufferStore) else node.source)

    tvm_ffi.structural_walk(stmt, ((tirx.BufferStore, tvm.ir.TensorLoad), visit), order="pre")
    return found
