"""The CPU (llvm) attention kernel of an `AttentionPlan` (planning/attention.py): online softmax, no
(q x kv) buffer.

A parallel task per (batch, KV head, query tile) holds the query rows of
every query head of that KV head (`plan.rows`), so one staged K and V tile
serves them all (grouped-query attention). The task stages its Q tile
(float32), then per key tile a transposed K tile and a V
tile, and

1. the tile's scores `Q K^T`: register blocks of `block_rows` rows by
   `score_cols` keys (accumulators in vector registers; per head-dim step a
   vector of `K^T` and a broadcast `q` per row);
2. per row, vectorised over the key tile: the scale, the mask (a causal one computed
   from the indices), the tile's max, the new running max `m'`, the
   rescale `exp(m - m')` of what came before, `p = exp(s - m')` in place of
   the scores and their sum;
3. the accumulators `acc exp(m - m') + P V`: register blocks of
   `block_rows` rows by `out_cols` head-dim columns, loaded rescaled, a
   vector of V and a broadcast `p` per row and key.

exp is `fast_exp` (vectorised) where the plan says so, else `tirx.exp`.
Key tiles past a causal diagonal are not visited, and a causal kernel
numbers its query tiles from both ends (tasks 0, 1, 2, 3 take tiles 0,
n-1, 1, n-2, ...) so that the contiguous ranges of tasks the runtime gives
each thread hold equal work.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, arguments, causal_key_tiles, f32, load, operand, seen, score
from schedules.cpu.fast_exp import fast_exp


def build(plan) -> tirx.PrimFunc:
    """The scheduled PrimFunc (q, k, v, [mask], [rotary tables], out) of `plan`."""
    s, rows = plan.shape, plan.rows
    with IRBuilder() as ib:
        with T.prim_func(is_private=True):
            bufs = arguments(s)
            with T.sblock("root"):
                with T.parallel(0, plan.tasks) as task:
                    tile = {
                        "q": T.alloc_buffer((rows, s.head_dim), "float32"),
                        "k": T.alloc_buffer((plan.k_tile, s.head_dim), "float32"),
                        "kt": T.alloc_buffer((s.head_dim, plan.k_tile), "float32"),
                        "v": T.alloc_buffer((plan.k_tile, s.head_dim), "float32"),
                        "s": T.alloc_buffer((rows, plan.k_tile), "float32"),
                        "acc": T.alloc_buffer((rows, s.head_dim), "float32"),
                        "m": T.alloc_buffer((rows,), "float32"),
                        "l": T.alloc_buffer((rows,), "float32"),
                        "alpha": T.alloc_buffer((rows,), "float32"),
                        "lanes": T.alloc_buffer((_lanes(plan),), "float32"),
                        "t": T.alloc_buffer((2,), "float32"),
                    }
                    _task(plan, bufs, tile, _indices(plan, task))
    return ib.get()


def _indices(plan, task) -> dict:
    """The task's batch, KV head, first query head and first query row."""
    s = plan.shape
    per_batch = s.heads // plan.shared_heads
    t = task % plan.q_tiles
    if s.mask == "causal":
        t = tirx.Select(t % 2 == 0, t // 2, plan.q_tiles - 1 - t // 2)
    outer = task // plan.q_tiles
    h0 = outer % per_batch * plan.shared_heads
    return {"b": outer // per_batch, "hk": h0 // s.group, "h0": h0, "q0": t * plan.q_tile}


def _row(plan, ids, r) -> tuple:
    """Query head and query position of row `r` of the task."""
    return ids["h0"] + r // plan.q_tile, ids["q0"] + r % plan.q_tile


def _task(plan, bufs, tile, ids):
    s = plan.shape
    zero = tirx.const(0.0, "float32")
    with T.serial(0, plan.rows) as r:
        h, qi = _row(plan, ids, r)
        _stage_row(s, bufs, "q", (ids["b"], h, tirx.min(qi, s.q_len - 1)), qi < s.q_len, tile["q"], r)
        with T.vectorized(0, s.head_dim) as d:
            T.buffer_store(tile["acc"], zero, [r, d])
        T.buffer_store(tile["m"], tirx.const(NEG, "float32"), [r])
        T.buffer_store(tile["l"], zero, [r])
    with T.serial(0, causal_key_tiles(plan, ids["q0"])) as kt:
        k0 = kt * plan.k_tile
        _stage_keys(plan, bufs, tile, ids, k0)
        _scores(plan, tile)
        with T.serial(0, plan.rows) as r:
            _softmax_row(plan, bufs, tile, ids, k0, r)
        _update(plan, tile)
    with T.serial(0, plan.rows) as r:
        h, qi = _row(plan, ids, r)
        with T.If(qi < s.q_len):
            with T.Then():
                with T.vectorized(0, s.head_dim) as d:
                    value = load(tile["acc"], r, d) / load(tile["l"], r)
                    T.buffer_store(bufs["out"], value if s.dtype == "float32" else tirx.Cast(s.dtype, value),
                                   [ids["b"], h, qi, d])


def _stage_keys(plan, bufs, tile, ids, k0):
    """K^T and V of the key tile at `k0` (float32; zeros past the keys): rows of K staged as V's are,
    then transposed within the cache."""
    s = plan.shape
    with T.serial(0, plan.k_tile) as j:
        row, inside = tirx.min(k0 + j, s.kv_len - 1), k0 + j < s.kv_len
        for name in ("k", "v"):
            _stage_row(s, bufs, name, (ids["b"], ids["hk"], row), inside, tile[name], j)
    with T.serial(0, s.head_dim) as d:
        with T.vectorized(0, plan.k_tile) as j:
            T.buffer_store(tile["kt"], load(tile["k"], j, d), [d, j])


def _stage_row(s, bufs, name, at, inside, dst, dst_row):
    """Row `at` (batch, head, position) of Q, K or V (`name`) as float32 (zero unless `inside`) into
    row `dst_row` of `dst`; in two vectorised halves of the head dimension, so that the rotary
    embedding's partner element (d + D/2 mod D) is a contiguous run too."""
    zero = tirx.const(0.0, "float32")
    half = s.head_dim // 2
    for lo, extent in ((0, half), (half, s.head_dim - half))[0 if half else 1:]:
        with T.vectorized(0, extent) as d:
            value = f32(operand(s, bufs, name, *at, lo + d))
            T.buffer_store(dst, tirx.Select(inside, value, zero), [dst_row, lo + d])


def _scores(plan, tile):
    """s = Q K^T of the tile."""
    _register_blocked(plan, plan.score_cols, plan.k_tile, plan.shape.head_dim, tile["s"],
                      lambda row, col: tirx.const(0.0, "float32"),
                      lambda row, k: load(tile["q"], row, k), lambda k, col: load(tile["kt"], k, col))


def _register_blocked(plan, cols, width, depth, out, start, left, right):
    """out[row, col] = start(row, col) + the sum over k < `depth` of left(row, k) * right(k, col),
    for the tile's rows and `width` columns, a block_rows x `cols` register block at a time."""
    rb = plan.block_rows
    reg = T.alloc_buffer((rb, cols), "float32", scope="local")
    with T.serial(0, plan.rows // rb) as i:
        with T.serial(0, width // cols) as c:
            with T.unroll(0, rb) as r:
                with T.vectorized(0, cols) as j:
                    T.buffer_store(reg, start(i * rb + r, c * cols + j), [r, j])
            with T.serial(0, depth) as k:
                with T.unroll(0, rb) as r:
                    with T.vectorized(0, cols) as j:
                        T.buffer_store(reg, load(reg, r, j) + left(i * rb + r, k) * right(k, c * cols + j), [r, j])
            with T.unroll(0, rb) as r:
                with T.vectorized(0, cols) as j:
                    T.buffer_store(out, load(reg, r, j), [i * rb + r, c * cols + j])


def _softmax_row(plan, bufs, tile, ids, k0, r):
    """Row `r`: masked scores, the tile's max, the new running max and the rescale of what came
    before, p = exp(s - m') in place of the scores, the running sum (vectorised over the key tile,
    folded into one vector register of lanes, then the lanes halved in a tree)."""
    s, lanes = plan.shape, _lanes(plan)
    h, qi = _row(plan, ids, r)
    exp = fast_exp if plan.fast_exp else tirx.exp
    sc, acc, t, m = tile["s"], tile["lanes"], tile["t"], tile["m"]
    _fill(acc, lanes, NEG)
    with T.serial(0, plan.k_tile // lanes) as c:
        with T.vectorized(0, lanes) as w:
            j = c * lanes + w
            value = score(s, bufs, load(sc, r, j), ids["b"], h, tirx.min(qi, s.q_len - 1),
                          tirx.min(k0 + j, s.kv_len - 1))
            T.buffer_store(sc, tirx.Select(seen(s, qi, k0 + j), value, tirx.const(NEG, "float32")), [r, j])
            T.buffer_store(acc, tirx.max(load(acc, w), load(sc, r, j)), [w])
    _fold(acc, lanes, t, tirx.max, load(m, r))  # t[0]: the new running max
    T.buffer_store(tile["alpha"], exp(load(m, r) - load(t, 0)), [r])
    T.buffer_store(m, load(t, 0), [r])
    _fill(acc, lanes, 0.0)
    with T.serial(0, plan.k_tile // lanes) as c:
        with T.vectorized(0, lanes) as w:
            j = c * lanes + w
            T.buffer_store(sc, exp(load(sc, r, j) - load(m, r)), [r, j])
            T.buffer_store(acc, load(acc, w) + load(sc, r, j), [w])
    _fold(acc, lanes, t, lambda a, b: a + b, load(tile["l"], r) * load(tile["alpha"], r))
    T.buffer_store(tile["l"], load(t, 0), [r])


def _lanes(plan) -> int:
    """float32 lanes of one vector register (at most the key tile)."""
    return min(plan.k_tile, max(plan.spec.vector_bytes // 4, 1))


def _fill(buf, extent, value):
    with T.vectorized(0, extent) as w:
        T.buffer_store(buf, tirx.const(value, "float32"), [w])


def _fold(lanes, extent, t, combine, start):
    """t[0] = `start` combined with every element of `lanes` (extent a power of two, halved in a tree)."""
    while extent > 1:
        extent //= 2
        with T.vectorized(0, extent) as w:
            T.buffer_store(lanes, combine(load(lanes, w), load(lanes, w + extent)), [w])
    T.buffer_store(t, combine(start, load(lanes, 0)), [0])


def _update(plan, tile):
    """acc = acc * alpha + P V of the tile."""
    _register_blocked(plan, plan.out_cols, plan.shape.head_dim, plan.k_tile, tile["acc"],
                      lambda row, col: load(tile["acc"], row, col) * load(tile["alpha"], row),
                      lambda row, k: load(tile["s"], row, k), lambda k, col: load(tile["v"], k, col))
