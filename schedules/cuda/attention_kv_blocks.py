"""The tensor-core attention kernel's key range split across blocks of one launch (plan.kv_blocks > 1).

Block `bx` takes query tile `bx // kv_blocks` and chunk `bx % kv_blocks` of
its key tiles (planning/attention_kv_blocks.py). After its online softmax
(and, where its key tiles are split over warps, their combine in shared
memory without the division by the sum) it writes, as chunk
`tile * kv_blocks + chunk` of the workspace, its unnormalised output tile
(`partial_o`, float32, q_tile x head_dim) and each row's max and sum
(`partial_ml`). Then the arrival protocol of schedules/cuda/arrivals.py
with one counter per tile and one combining block: every thread fences,
the block synchronises, thread 0 takes the tile's ticket, and the block
whose ticket is `kv_blocks - 1` (it sees every ticket taken) combines
(its thread 0, which took the ticket, passes the wait for all arrivals
and resets the counter at once: a thread of the block that read the
counter after the reset would wait forever; the others read the partials
after the barrier that follows the ticket, as every block's writes were
fenced before its ticket):
each thread takes one query row and `head_dim / (threads / q_tile)` of its
columns and passes over the chunks once, as the online softmax passes over
key tiles: per chunk its row max and sum (one 8-byte load) and its output
columns (16-byte loads), the running max `M`, the rescale `exp(M - M')` of
the running sum and output, the chunk's weight `exp(m - M')`; it writes
`O / L` where the row exists.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, load
from schedules.cuda import arrivals, attention_split
from tvm_stitch.planning import attention_kv_blocks as attention_kv_blocks_plan

C_ELEMENTS = 4  # float32 accumulators a lane holds of one 16 x 8 mma tile


def chunk_tiles(plan, chunk, last_tile):
    """(first key tile, key tiles) of chunk `chunk`, up to `last_tile` (exclusive)."""
    per_chunk = attention_kv_blocks_plan.chunk_tiles(plan)
    first = chunk * per_chunk
    return first, tirx.max(0, tirx.min(first + per_chunk, last_tile) - first)


def finish(plan, bufs, regs, ids):
    """After the key loop: the block's partials to the workspace, its arrival, and the combine by the last."""
    if plan.kv_splits > 1:
        attention_split.combine(plan, bufs, regs, ids, _store_partial, normalise=False)
        stats, writer = (regs["t"], regs["a"]), tirx.all(ids["split"] == plan.kv_splits - 1, ids["lane"] % 4 == 0)
    else:
        for half in range(2):
            _store_partial(plan, bufs, regs, ids, half, lambda i, col: load(regs["o"], i))
        stats, writer = (regs["m"], regs["l"]), ids["lane"] % 4 == 0
    ml, at = bufs["partial_ml"], ids["chunk_index"] * plan.q_tile
    with T.If(writer):
        with T.Then():
            with T.unroll(0, 2) as half:
                r = at + ids["warp_row"] + ids["lane"] // 4 + 8 * half
                T.buffer_store(ml, load(stats[0], half), [2 * r])
                T.buffer_store(ml, load(stats[1], half), [2 * r + 1])
    T.evaluate(arrivals.fence())
    T.evaluate(T.tvm_storage_sync("shared"))
    turn = T.alloc_buffer((1,), "int32", scope="shared")
    mine = T.alloc_buffer((1,), "int32", scope="local")
    with T.If(ids["tx"] == 0):
        with T.Then():
            T.buffer_store(turn, arrivals.ticket(ids["tile"]), [0])
    T.evaluate(T.tvm_storage_sync("shared"))
    T.buffer_store(mine, load(turn, 0), [0])
    with T.If(load(mine, 0) == plan.kv_blocks - 1):
        with T.Then():
            with T.If(ids["tx"] == 0):  # the thread that took the ticket: no other thread reads the counter
                with T.Then():
                    T.evaluate(arrivals.await_arrivals(ids["tile"], plan.kv_blocks))
                    T.evaluate(arrivals.reset(ids["tile"]))
            _combine(plan, bufs, ids)


def _store_partial(plan, bufs, regs, ids, half, value_of):
    """partial_o[chunk, row g (+ 8 `half`) of the warp, the lane's columns] = value_of(accumulator, column)."""
    d = plan.shape.head_dim
    r = ids["chunk_index"] * plan.q_tile + ids["warp_row"] + ids["lane"] // 4 + 8 * half
    with T.unroll(0, d // 8 * 2) as e:
        i, col = (e // 2) * C_ELEMENTS + 2 * half + e % 2, (e // 2) * 8 + ids["col"] + e % 2
        T.buffer_store(bufs["partial_o"], value_of(i, col), [r * d + col])


def _combine(plan, bufs, ids):
    """out[tile's rows] = sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M): a row and `cols` columns a thread,
    one pass over the chunks (the online softmax's rescale where the max grows), vector loads."""
    s = plan.shape
    cols, vector = attention_kv_blocks_plan.combine_columns(plan), attention_kv_blocks_plan.combine_vector(plan)
    parts = s.head_dim // cols
    row, c0 = ids["tx"] // parts, ids["tx"] % parts * cols
    acc = T.alloc_buffer((cols,), "float32", scope="local")
    chunk = T.alloc_buffer((2,), "float32", scope="local")  # the chunk's row max and sum
    stat = T.alloc_buffer((4,), "float32", scope="local")  # M, L, the rescale of both, the chunk's weight
    first = ids["tile"] * plan.kv_blocks * plan.q_tile + row  # the row of chunk 0
    o, ml = bufs["partial_o"], bufs["partial_ml"]
    T.buffer_store(stat, tirx.const(NEG, "float32"), [0])
    T.buffer_store(stat, tirx.const(0.0, "float32"), [1])
    with T.unroll(0, cols) as j:
        T.buffer_store(acc, tirx.const(0.0, "float32"), [j])
    with T.unroll(0, plan.kv_blocks) as c:
        r = first + c * plan.q_tile
        with T.vectorized(0, 2) as j:
            T.buffer_store(chunk, load(ml, 2 * r + j), [j])
        T.buffer_store(stat, tirx.max(load(stat, 0), load(chunk, 0)), [3])
        T.buffer_store(stat, tirx.exp(load(stat, 0) - load(stat, 3)), [2])
        T.buffer_store(stat, load(stat, 3), [0])
        T.buffer_store(stat, tirx.exp(load(chunk, 0) - load(stat, 0)), [3])
        T.buffer_store(stat, load(stat, 1) * load(stat, 2) + load(chunk, 1) * load(stat, 3), [1])
        with T.unroll(0, cols // vector) as v:
            with T.vectorized(0, vector) as j:
                k = v * vector + j
                T.buffer_store(acc, load(acc, k) * load(stat, 2) + load(o, r * s.head_dim + c0 + k) * load(stat, 3),
                               [k])
    qi = ids["q0"] + row
    with T.If(qi < s.q_len):
        with T.Then():
            with T.unroll(0, cols) as j:
                T.buffer_store(bufs["out"], tirx.Cast(s.dtype, load(acc, j) / load(stat, 1)),
                               [ids["b"], ids["h"], qi, c0 + j])
