"""The CUDA attention kernel of an `AttentionPlan` (planning/attention.py): one launch, online softmax.

A block per (batch, head, query tile) of `plan.q_tile` rows, `plan.lanes`
threads per row. Per key tile: K and V tiles staged in shared memory
(float32, rows padded), each thread computes the scores of its key columns
(`lane`, `lane + lanes`, ...) from the staged Q row, every thread of a row
takes the row's max over the tile, writes `exp(s - m')` of its columns, and
adds the tile's share to its `head_dim / lanes` accumulators (registers),
rescaled by `exp(m - m')`. Key tiles past a causal diagonal are not visited.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, causal_key_tiles, cuda_kernel, f32, load, operand, query_tile, seen, score


def build(plan) -> tirx.PrimFunc:
    """The scheduled PrimFunc (q, k, v, [mask], out) of `plan`."""
    def body(bufs, bx, tx):
        s = plan.shape
        smem = {
            "q": _Padded(plan.q_tile, s.head_dim),
            "k": _Padded(plan.k_tile, s.head_dim),
            "v": _Padded(plan.k_tile, s.head_dim),
            "p": _Padded(plan.q_tile, plan.k_tile),
        }
        regs = {
            "acc": T.alloc_buffer((s.head_dim // plan.lanes,), "float32", scope="local"),
            "m": T.alloc_buffer((1,), "float32", scope="local"),
            "l": T.alloc_buffer((1,), "float32", scope="local"),
            "t": T.alloc_buffer((1,), "float32", scope="local"),
            "a": T.alloc_buffer((1,), "float32", scope="local"),
        }
        _block_body(plan, bufs, smem, regs, bx, tx)

    return cuda_kernel(plan, body)


class _Padded:
    """A 2-d float32 tile in shared memory, rows padded by one element (flat, so that buffer
    compaction keeps the padding): threads reading one column of several rows hit different banks."""

    def __init__(self, rows: int, cols: int):
        self.cols = cols + 1
        self.buf = T.alloc_buffer((rows * self.cols,), "float32", scope="shared")

    def __getitem__(self, rc):
        return load(self.buf, rc[0] * self.cols + rc[1])

    def store(self, value, r, c):
        T.buffer_store(self.buf, value, [r * self.cols + c])


def _block_body(plan, bufs, smem, regs, bx, tx):
    s = plan.shape
    b, h, q0 = query_tile(plan, bx)
    ids = {"b": b, "h": h, "hk": h // s.group, "q0": q0, "r": tx // plan.lanes, "lane": tx % plan.lanes,
           "tx": tx}
    _stage_rows(plan, smem["q"], bufs, "q", (b, h), q0, s.q_len, plan.q_tile, tx)
    acc, m, l = regs["acc"], regs["m"], regs["l"]
    with T.serial(0, s.head_dim // plan.lanes) as i:
        T.buffer_store(acc, tirx.const(0.0, "float32"), [i])
    T.buffer_store(m, tirx.const(NEG, "float32"), [0])
    T.buffer_store(l, tirx.const(0.0, "float32"), [0])
    with T.serial(0, causal_key_tiles(plan, q0)) as kt:
        _key_tile(plan, bufs, smem, regs, ids, kt)
    _write_rows(plan, bufs, regs, ids)


def _stage_rows(plan, dst, bufs, name, head, row0, rows, tile, tx):
    """dst[r, d] = operand `name`[head..., row0 + r, d] as float32 (0 past `rows`), the block's threads in
    turn."""
    d = plan.shape.head_dim
    with T.serial(0, -(-tile * d // plan.threads)) as it:
        idx = it * plan.threads + tx
        with T.If(idx < tile * d):
            with T.Then():
                r, c = idx // d, idx % d
                with T.If(row0 + r < rows):
                    with T.Then():
                        dst.store(f32(operand(plan.shape, bufs, name, *head, row0 + r, c)), r, c)
                    with T.Else():
                        dst.store(tirx.const(0.0, "float32"), r, c)


def _key_tile(plan, bufs, smem, regs, ids, kt):
    s = plan.shape
    k0 = kt * plan.k_tile
    T.evaluate(T.tvm_storage_sync("shared"))
    _stage_rows(plan, smem["k"], bufs, "k", (ids["b"], ids["hk"]), k0, s.kv_len, plan.k_tile, ids["tx"])
    _stage_rows(plan, smem["v"], bufs, "v", (ids["b"], ids["hk"]), k0, s.kv_len, plan.k_tile, ids["tx"])
    T.evaluate(T.tvm_storage_sync("shared"))
    r, lane, qi = ids["r"], ids["lane"], ids["q0"] + ids["r"]
    t, p = regs["t"], smem["p"]
    with T.serial(0, plan.k_tile // plan.lanes) as jj:
        j = jj * plan.lanes + lane
        T.buffer_store(t, tirx.const(0.0, "float32"), [0])
        with T.serial(0, s.head_dim) as d:
            T.buffer_store(t, load(t, 0) + smem["q"][r, d] * smem["k"][j, d], [0])
        value = score(s, bufs, load(t, 0), ids["b"], ids["h"], qi, k0 + j)
        p.store(tirx.Select(seen(s, qi, k0 + j), value, tirx.const(NEG, "float32")), r, j)
    T.evaluate(T.tvm_storage_sync("shared"))
    m_new = regs["t"]
    T.buffer_store(m_new, load(regs["m"], 0), [0])
    with T.serial(0, plan.k_tile) as j:
        T.buffer_store(m_new, tirx.max(load(m_new, 0), p[r, j]), [0])
    _rescale(plan, smem, regs, ids, k0)


def _rescale(plan, smem, regs, ids, k0):
    """The row's new max is in regs["t"]: exp of this thread's columns, then the running sum and output."""
    s = plan.shape
    r, lane, qi = ids["r"], ids["lane"], ids["q0"] + ids["r"]
    p, m_new, m, l, acc = smem["p"], regs["t"], regs["m"], regs["l"], regs["acc"]
    T.evaluate(T.tvm_storage_sync("shared"))
    with T.serial(0, plan.k_tile // plan.lanes) as jj:
        j = jj * plan.lanes + lane
        p.store(tirx.Select(seen(s, qi, k0 + j), tirx.exp(p[r, j] - load(m_new, 0)), tirx.const(0.0, "float32")),
                r, j)
    T.evaluate(T.tvm_storage_sync("shared"))
    alpha = regs["a"]
    T.buffer_store(alpha, tirx.exp(load(m, 0) - load(m_new, 0)), [0])
    T.buffer_store(m, load(m_new, 0), [0])
    T.buffer_store(l, load(l, 0) * load(alpha, 0), [0])
    with T.serial(0, s.head_dim // plan.lanes) as i:
        T.buffer_store(acc, load(acc, i) * load(alpha, 0), [i])
    with T.serial(0, plan.k_tile) as j:
        T.buffer_store(l, load(l, 0) + p[r, j], [0])
        with T.serial(0, s.head_dim // plan.lanes) as i:
            T.buffer_store(acc, load(acc, i) + p[r, j] * smem["v"][j, i * plan.lanes + lane], [i])


def _write_rows(plan, bufs, regs, ids):
    s = plan.shape
    qi = ids["q0"] + ids["r"]
    with T.If(qi < s.q_len):
        with T.Then():
            with T.serial(0, s.head_dim // plan.lanes) as i:
                value = load(regs["acc"], i) / load(regs["l"], 0)
                out = value if s.dtype == "float32" else tirx.Cast(s.dtype, value)
                T.buffer_store(bufs["out"], out, [ids["b"], ids["h"], qi, i * plan.lanes + ids["lane"]])
