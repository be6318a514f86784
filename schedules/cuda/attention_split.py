"""The combine of a tensor-core attention block whose key tiles are split over warps (plan.kv_splits > 1).

Each of the `kv_splits` warps of one 16-row query slice ran the online
softmax over its own keys of every key tile (schedules/cuda/attention_mma.py):
per row it holds a running max `m_w`, a running sum `l_w` (already folded
over its quad) and output accumulators `o_w`, all relative to `m_w`. They
are combined as the online softmax combines two key ranges:

1. one lane of each quad writes its rows' `m_w` and `l_w` to shared memory;
2. after a barrier every lane reads its rows' values of all splits: the row
   max `M = max_w m_w`, the row sum `L = sum_w l_w exp(m_w - M)`, and its
   own weight `exp(m_w - M) / L`;
3. each warp weights its `o_w` by that; in turn, split w - 1 writes its sum
   so far to a float32 output tile in shared memory and, after a barrier,
   split w adds it to its own (every lane reads the tile, the others keep
   theirs: no shared read under a lane-dependent branch); the last split
   writes the sum in the input dtype.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, load

C_ELEMENTS = 4  # float32 accumulators a lane holds of one 16 x 8 mma tile


def combine(plan, bufs, regs, ids, store_output, normalise: bool = True):
    """Combine the splits' (m, l, o) of each query row and write the output through
    `store_output(plan, bufs, regs, ids, half, value_of)` (value_of(accumulator index, column));
    `normalise=False`: the output not divided by the row sum, which stays in regs["a"] (the row max in
    regs["t"]) for a combine across blocks (schedules/cuda/attention_kv_blocks.py)."""
    s, splits = plan.shape, plan.kv_splits
    stats = T.alloc_buffer((2 * splits * plan.q_tile,), "float32", scope="shared")
    acc = T.alloc_buffer((plan.q_tile * s.head_dim,), "float32", scope="shared")
    lane = ids["lane"]

    def row(half):
        return ids["warp_row"] + lane // 4 + 8 * half

    def at(kind, split, half):
        return (kind * splits + split) * plan.q_tile + row(half)

    with T.If(lane % 4 == 0):
        with T.Then():
            with T.unroll(0, 2) as half:
                T.buffer_store(stats, load(regs["m"], half), [at(0, ids["split"], half)])
                T.buffer_store(stats, load(regs["l"], half), [at(1, ids["split"], half)])
    T.evaluate(T.tvm_storage_sync("shared"))
    _weights(s, ids, regs, stats, at, splits, normalise)
    o = regs["o"]
    for split in range(1, splits):
        with T.If(ids["split"] == split - 1):
            with T.Then():
                with T.unroll(0, 2) as half:
                    _each_output(s, ids, half, lambda i, col, half=half: T.buffer_store(
                        acc, load(o, i), [row(half) * s.head_dim + col]))
        T.evaluate(T.tvm_storage_sync("shared"))
        with T.unroll(0, 2) as half:
            _each_output(s, ids, half, lambda i, col, half=half, split=split: T.buffer_store(o, tirx.Select(
                ids["split"] == split, load(o, i) + load(acc, row(half) * s.head_dim + col), load(o, i)), [i]))
    with T.If(ids["split"] == splits - 1):
        with T.Then():
            with T.unroll(0, 2) as half:
                store_output(plan, bufs, regs, ids, half, lambda i, col: load(o, i))


def _weights(shape, ids, regs, stats, at, splits, normalise):
    """Per row half: t = the row max over the splits, a = the row sum, m = this warp's weight exp(m - t) / a
    (exp(m - t) unless `normalise`), the output accumulators o multiplied by it."""
    m, t, a = regs["m"], regs["t"], regs["a"]
    with T.unroll(0, 2) as half:
        T.buffer_store(t, tirx.const(NEG, "float32"), [half])
        T.buffer_store(a, tirx.const(0.0, "float32"), [half])
        with T.unroll(0, splits) as split:
            T.buffer_store(t, tirx.max(load(t, half), load(stats, at(0, split, half))), [half])
        with T.unroll(0, splits) as split:
            weight = tirx.exp(load(stats, at(0, split, half)) - load(t, half))
            T.buffer_store(a, load(a, half) + load(stats, at(1, split, half)) * weight, [half])
        weight = tirx.exp(load(m, half) - load(t, half))
        T.buffer_store(m, weight / load(a, half) if normalise else weight, [half])
        _each_output(shape, ids, half, lambda i, col, half=half: T.buffer_store(
            regs["o"], load(regs["o"], i) * load(m, half), [i]))


def _each_output(shape, ids, half, body):
    """body(accumulator index, column) for each output element the lane holds of row g (+ 8 `half`)."""
    with T.unroll(0, shape.head_dim // 8 * 2) as e:
        body((e // 2) * C_ELEMENTS + 2 * half + e % 2, (e // 2) * 8 + ids["col"] + e % 2)
