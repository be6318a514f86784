"""The CPU (llvm) attention kernel of an `AttentionPlan` (planning/attention.py): online softmax, no
(q x kv) buffer.

A parallel task per (batch, head, query tile). The task stages its Q tile
(float32), then per key tile a transposed K tile and a V tile; each query
row's scores for the tile are a vectorised sum of `q[d] * K^T[d, :]` rows,
its running max, running sum and output accumulators (float32) are
rescaled by `exp(m - m')` and take the tile's `exp(s - m')` and
`exp(s - m') V` (vectorised over the head dimension). Key tiles past a
causal diagonal are not visited.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, arguments, causal_key_tiles, f32, load, operand, seen, score


def build(plan) -> tirx.PrimFunc:
    """The scheduled PrimFunc (q, k, v, [mask], out) of `plan`."""
    s = plan.shape
    with IRBuilder() as ib:
        with T.prim_func(is_private=True):
            bufs = arguments(s)
            with T.sblock("root"):
                with T.parallel(0, plan.tasks) as task:
                    tile = {
                        "q": T.alloc_buffer((plan.q_tile, s.head_dim), "float32"),
                        "kt": T.alloc_buffer((s.head_dim, plan.k_tile), "float32"),
                        "v": T.alloc_buffer((plan.k_tile, s.head_dim), "float32"),
                        "s": T.alloc_buffer((plan.k_tile,), "float32"),
                        "acc": T.alloc_buffer((plan.q_tile, s.head_dim), "float32"),
                        "m": T.alloc_buffer((plan.q_tile,), "float32"),
                        "l": T.alloc_buffer((plan.q_tile,), "float32"),
                        "t": T.alloc_buffer((2,), "float32"),
                    }
                    _task(plan, bufs, tile, task)
    return ib.get()


def _task(plan, bufs, tile, task):
    s = plan.shape
    b, h = task // (s.heads * plan.q_tiles), task // plan.q_tiles % s.heads
    q0 = task % plan.q_tiles * plan.q_tile
    ids = {"b": b, "h": h, "hk": h // s.group, "q0": q0}
    with T.serial(0, plan.q_tile) as r:
        with T.vectorized(0, s.head_dim) as d:
            T.buffer_store(tile["q"], tirx.Select(q0 + r < s.q_len,
                                                  f32(operand(s, bufs, "q", b, h, tirx.min(q0 + r, s.q_len - 1), d)),
                                                  tirx.const(0.0, "float32")), [r, d])
            T.buffer_store(tile["acc"], tirx.const(0.0, "float32"), [r, d])
        T.buffer_store(tile["m"], tirx.const(NEG, "float32"), [r])
        T.buffer_store(tile["l"], tirx.const(0.0, "float32"), [r])
    with T.serial(0, causal_key_tiles(plan, q0)) as kt:
        _stage_keys(plan, bufs, tile, ids, kt * plan.k_tile)
        with T.serial(0, plan.q_tile) as r:
            _row(plan, bufs, tile, ids, kt * plan.k_tile, r)
    with T.serial(0, tirx.min(plan.q_tile, s.q_len - q0)) as r:
        with T.vectorized(0, s.head_dim) as d:
            value = load(tile["acc"], r, d) / load(tile["l"], r)
            T.buffer_store(bufs["out"], value if s.dtype == "float32" else tirx.Cast(s.dtype, value),
                           [b, h, q0 + r, d])


def _stage_keys(plan, bufs, tile, ids, k0):
    """K^T and V of the key tile at `k0` (float32; zeros past the keys)."""
    s = plan.shape
    with T.serial(0, plan.k_tile) as j:
        row = tirx.min(k0 + j, s.kv_len - 1)
        inside = k0 + j < s.kv_len
        zero = tirx.const(0.0, "float32")
        with T.serial(0, s.head_dim) as d:
            k = f32(operand(s, bufs, "k", ids["b"], ids["hk"], row, d))
            T.buffer_store(tile["kt"], tirx.Select(inside, k, zero), [d, j])
        with T.vectorized(0, s.head_dim) as d:
            v = f32(operand(s, bufs, "v", ids["b"], ids["hk"], row, d))
            T.buffer_store(tile["v"], tirx.Select(inside, v, zero), [j, d])


def _row(plan, bufs, tile, ids, k0, r):
    """One query row against the key tile: scores, new max, rescaled sum and accumulators."""
    s, qi = plan.shape, ids["q0"] + r
    sc, t, m, l, acc = tile["s"], tile["t"], tile["m"], tile["l"], tile["acc"]
    with T.vectorized(0, plan.k_tile) as j:
        T.buffer_store(sc, tirx.const(0.0, "float32"), [j])
    with T.serial(0, s.head_dim) as d:
        with T.vectorized(0, plan.k_tile) as j:
            T.buffer_store(sc, load(sc, j) + load(tile["q"], r, d) * load(tile["kt"], d, j), [j])
    T.buffer_store(t, load(m, r), [0])
    with T.serial(0, plan.k_tile) as j:
        value = score(s, bufs, load(sc, j), ids["b"], ids["h"], tirx.min(qi, s.q_len - 1),
                      tirx.min(k0 + j, s.kv_len - 1))
        T.buffer_store(sc, tirx.Select(seen(s, qi, k0 + j), value, tirx.const(NEG, "float32")), [j])
        T.buffer_store(t, tirx.max(load(t, 0), load(sc, j)), [0])
    T.buffer_store(t, tirx.exp(load(m, r) - load(t, 0)), [1])  # the rescale of what came before
    T.buffer_store(m, load(t, 0), [r])
    T.buffer_store(l, load(l, r) * load(t, 1), [r])
    with T.serial(0, plan.k_tile) as j:
        T.buffer_store(sc, tirx.Select(seen(s, qi, k0 + j), tirx.exp(load(sc, j) - load(m, r)),
                                       tirx.const(0.0, "float32")), [j])
        T.buffer_store(l, load(l, r) + load(sc, j), [r])
    with T.vectorized(0, s.head_dim) as d:
        T.buffer_store(acc, load(acc, r, d) * load(t, 1), [r, d])
    with T.serial(0, plan.k_tile) as j:
        with T.vectorized(0, s.head_dim) as d:
            T.buffer_store(acc, load(acc, r, d) + load(sc, j) * load(tile["v"], j, d), [r, d])
