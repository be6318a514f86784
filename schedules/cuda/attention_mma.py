"""The CUDA attention kernel on tensor cores (float16, bfloat16): FlashAttention-2's structure on mma.sync.

A block per (batch, head, query tile) of `plan.q_tile` rows, one warp per 16
query rows (`plan.threads` = 32 per 16 rows). Q, K and V tiles are staged in
shared memory in their own dtype (rows padded by 8 elements: 16-byte
aligned row addresses for ldmatrix, and the 8 rows of one 8 x 8 matrix in
different banks). Each warp loads its 16 x head_dim slice of Q into mma A
fragments once (`ldmatrix .x4`), then per key tile:

1. S = Q K^T on `mma.sync.m16n8k16.row.col` with float32 accumulators: K
   tiles read as B fragments by `ldmatrix .x4` (K's rows are B's columns);
2. the online softmax on the accumulator fragments: a lane holds, per 8
   keys, columns 2t, 2t + 1 of rows g and g + 8 (g = lane / 4, t = lane % 4,
   PTX's C layout); the scale and mask are applied per element, each row's
   max is the lane's max folded over the 4 lanes of its quad
   (`shfl.xor` 1 and 2), the running max `m`, the rescale `exp(m - m')`
   of the lane's running sum and output accumulators, `p = exp(s - m')`;
3. O += P V: P converted to the input dtype in registers (the C fragments of
   two adjacent 8-key blocks are the A fragment of their 16 keys), V read
   as B fragments by `ldmatrix .x4 .trans`.

The lanes' partial sums are folded over their quads at the end, and each
lane writes its output elements `acc / l`. Key tiles past a causal diagonal
are not visited; keys past the key length and past the diagonal score -3e38.
The intrinsics are written directly (`T.ptx_legacy.ldmatrix`, `T.ptx_legacy.mma`,
`tvm_warp_shuffle_xor`): the same TIR runs under the SIMT checker, which
emulates each lane by lane (simt/mma_emulation.py).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedules.attention_common import NEG, causal_key_tiles, cuda_kernel, load, operand, query_tile, score, seen
from schedules.cuda import attention_kv_blocks, attention_split
from schedules.mma_intrinsics import DTYPES, ldmatrix_row
from tvm_stitch.planning import attention_kv_blocks as attention_kv_blocks_plan

TILE = 16  # rows of a warp, and the depth and width of one ldmatrix .x4 / two mma
PAD = 8  # elements each shared-memory row is padded by
C_ELEMENTS = 4  # float32 accumulators a lane holds of one 16 x 8 mma tile
FULL_MASK = 0xFFFFFFFF
MIN_BLOCKS_PER_SM = 1  # __launch_bounds__(threads, 1): else ptxas trades registers for occupancy and spills
#                        (16-key warp tiles: 80 registers, 16 bytes spilled); the plan prices its own occupancy


def build(plan) -> tirx.PrimFunc:
    """The scheduled PrimFunc (q, k, v, [mask], out) of an `mma` plan."""
    def body(bufs, bx, tx):
        smem = {name: _Tile(rows, plan.shape.head_dim, plan.shape.dtype) for name, rows in
                (("q", plan.q_tile), ("k", plan.k_tile), ("v", plan.k_tile))}
        _block_body(plan, bufs, smem, _registers(plan), bx, tx)

    workspaces = attention_kv_blocks_plan.workspace_elements(plan) if plan.kv_blocks > 1 else None
    return cuda_kernel(plan, body, MIN_BLOCKS_PER_SM, workspaces)


class _Tile:
    """A 2-d tile of the input dtype in shared memory, rows padded by PAD elements (flat)."""

    def __init__(self, rows: int, cols: int, dtype: str):
        self.stride = cols + PAD
        self.buf = T.alloc_buffer((rows * self.stride,), dtype, scope="shared")

    def store(self, value, r, c):
        T.buffer_store(self.buf, value, [r * self.stride + c])


def _registers(plan) -> dict:
    """Per-lane fragments (local arrays the mma instructions address by offset) and row statistics."""
    s = plan.shape
    d, kt = s.head_dim, plan.k_tile // plan.kv_splits
    local = {
        "q": ((d // TILE) * 8, s.dtype),  # A fragments of the warp's 16 rows, per 16 of head_dim
        "b": (8, s.dtype),  # one ldmatrix .x4 of K or V: the B fragments of two mma
        "s": ((kt // 8) * C_ELEMENTS, "float32"),  # the scores of the warp's keys, per 8 keys
        "p": ((kt // 8) * C_ELEMENTS, s.dtype),  # exp(s - m') in the input dtype: A fragments per 16 keys
        "o": ((d // 8) * C_ELEMENTS, "float32"),  # the output accumulators, per 8 of head_dim
        "m": (2, "float32"),  # rows g and g + 8: running max
        "l": (2, "float32"),  # running sum of this lane's columns
        "t": (2, "float32"),  # the row's new max m'
        "a": (2, "float32"),  # the rescale exp(m - m')
    }
    return {name: T.alloc_buffer((n,), dtype, scope="local") for name, (n, dtype) in local.items()}


def _block_body(plan, bufs, smem, regs, bx, tx):
    s = plan.shape
    tile, chunk = (bx // plan.kv_blocks, bx % plan.kv_blocks) if plan.kv_blocks > 1 else (bx, 0)
    b, h, q0 = query_tile(plan, tile)
    warp, lane = tx // plan.spec.warp_size, tx % plan.spec.warp_size
    rows, split = warp // plan.kv_splits, warp % plan.kv_splits
    ids = {"b": b, "h": h, "hk": h // s.group, "q0": q0, "tx": tx, "lane": lane, "warp": plan.spec.warp_size,
           "row": q0 + rows * TILE + lane // 4, "col": 2 * (lane % 4), "warp_row": rows * TILE, "split": split,
           "warp_keys": plan.k_tile // plan.kv_splits, "tile": tile, "chunk_index": bx}
    _stage(plan, smem["q"], bufs, "q", (b, h), q0, s.q_len, plan.q_tile, tx)
    T.evaluate(T.tvm_storage_sync("shared"))
    with T.unroll(0, s.head_dim // TILE) as kk:
        _ldmatrix(plan, regs["q"], kk * 8, smem["q"], ids["warp_row"], kk * TILE, "a", False, lane)
    _fill(regs["o"], 0.0)
    _fill(regs["m"], NEG)
    _fill(regs["l"], 0.0)
    if plan.kv_blocks > 1:
        first, count = attention_kv_blocks.chunk_tiles(plan, chunk, causal_key_tiles(plan, q0))
        with T.serial(0, count) as kt:
            _key_tile(plan, bufs, smem, regs, ids, first + kt)
    else:
        with T.serial(0, causal_key_tiles(plan, q0)) as kt:
            _key_tile(plan, bufs, smem, regs, ids, kt)
    _fold_sums(regs, ids)
    if plan.kv_blocks > 1:
        attention_kv_blocks.finish(plan, bufs, regs, ids)
    elif plan.kv_splits > 1:
        attention_split.combine(plan, bufs, regs, ids, _store_output)
    else:
        _write(plan, bufs, regs, ids)


def _fill(buf, value):
    with T.unroll(0, buf.shape[0]) as i:
        T.buffer_store(buf, tirx.const(value, "float32"), [i])


def _stage(plan, dst, bufs, name, head, row0, rows, tile, tx):
    """dst[r, d] = operand `name`[head..., row0 + r, d] (0 past `rows`), 8 elements a thread in turn."""
    d = plan.shape.head_dim
    chunks = tile * d // 8
    with T.serial(0, -(-chunks // plan.threads)) as it:
        idx = it * plan.threads + tx
        with T.If(idx < chunks):
            with T.Then():
                r, c0 = idx // (d // 8), idx % (d // 8) * 8
                loop = T.vectorized if not plan.shape.operands else T.unroll
                with T.If(row0 + r < rows):
                    with T.Then():
                        with loop(0, 8) as c:
                            value = operand(plan.shape, bufs, name, *head, row0 + r, c0 + c)
                            if str(value.ty.dtype) != plan.shape.dtype:
                                value = tirx.Cast(plan.shape.dtype, value)
                            dst.store(value, r, c0 + c)
                    with T.Else():
                        with loop(0, 8) as c:
                            dst.store(tirx.const(0.0, plan.shape.dtype), r, c0 + c)


def _ldmatrix(plan, frag, offset, tile, row0, col0, operand_kind, trans, lane):
    """One ldmatrix .x4 of the 16 x 16 tile at (row0, col0) of `tile` into frag[offset: offset + 8]."""
    r, c = ldmatrix_row(lane, operand_kind, trans)
    T.evaluate(T.ptx_legacy.ldmatrix(trans, 4, ".b16", frag.data, offset, tile.buf.access_ptr("r"),
                                     (row0 + r) * tile.stride + col0 + c, dtype=plan.shape.dtype))


def _mma(plan, a, a_off, b, b_off, c, c_off):
    ptx = DTYPES[plan.shape.dtype]
    T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32", a.data, a_off, b.data, b_off,
                                c.data, c_off, False, dtype="float32"))


def _key_tile(plan, bufs, smem, regs, ids, kt):
    s = plan.shape
    k0 = kt * plan.k_tile
    T.evaluate(T.tvm_storage_sync("shared"))
    _stage(plan, smem["k"], bufs, "k", (ids["b"], ids["hk"]), k0, s.kv_len, plan.k_tile, ids["tx"])
    _stage(plan, smem["v"], bufs, "v", (ids["b"], ids["hk"]), k0, s.kv_len, plan.k_tile, ids["tx"])
    T.evaluate(T.tvm_storage_sync("shared"))
    sf, frag = regs["s"], regs["b"]
    wk = ids["warp_keys"]
    key_row = ids["split"] * wk  # the warp's first key in the staged tiles
    _fill(sf, 0.0)
    with T.unroll(0, wk // TILE) as nn:
        with T.unroll(0, s.head_dim // TILE) as kk:
            _ldmatrix(plan, frag, 0, smem["k"], key_row + nn * TILE, kk * TILE, "b", False, ids["lane"])
            for half in range(2):
                _mma(plan, regs["q"], kk * 8, frag, 4 * half, sf, (2 * nn + half) * C_ELEMENTS)
    _softmax(plan, bufs, regs, ids, k0 + key_row)
    with T.unroll(0, wk // TILE) as kk:
        with T.unroll(0, s.head_dim // TILE) as dn:
            _ldmatrix(plan, frag, 0, smem["v"], key_row + kk * TILE, dn * TILE, "b", True, ids["lane"])
            for half in range(2):
                _mma(plan, regs["p"], kk * 8, frag, 4 * half, regs["o"], (2 * dn + half) * C_ELEMENTS)


def _quad(op, value, warp: int):
    """`value` folded by `op` over the 4 lanes of the caller's quad (the lanes holding one row)."""
    for lane_mask in (1, 2):
        other = T.tvm_warp_shuffle_xor(tirx.const(FULL_MASK, "uint32"), value, lane_mask, warp, warp)
        value = op(value, other)
    return value


def _softmax(plan, bufs, regs, ids, k0):
    """Scale and mask the score fragments, take each row's new max, rescale the lane's running sum and
    output accumulators, and write p = exp(s - m') (0 for unseen keys) to the P fragments."""
    s = plan.shape
    sf, m, l, t = regs["s"], regs["m"], regs["l"], regs["t"]
    blocks = ids["warp_keys"] // 8
    with T.unroll(0, 2) as half:
        qi = ids["row"] + 8 * half
        T.buffer_store(t, load(m, half), [half])
        with T.unroll(0, blocks * 2) as e:
            i = (e // 2) * C_ELEMENTS + 2 * half + e % 2
            kj = k0 + (e // 2) * 8 + ids["col"] + e % 2
            value = score(s, bufs, load(sf, i), ids["b"], ids["h"], qi, kj)
            T.buffer_store(sf, tirx.Select(seen(s, qi, kj), value, tirx.const(NEG, "float32")), [i])
            T.buffer_store(t, tirx.max(load(t, half), load(sf, i)), [half])
        T.buffer_store(t, _quad(tirx.max, load(t, half), ids["warp"]), [half])
        m_new = load(t, half)
        with T.unroll(0, blocks * 2) as e:
            i = (e // 2) * C_ELEMENTS + 2 * half + e % 2
            kj = k0 + (e // 2) * 8 + ids["col"] + e % 2
            p = tirx.Select(seen(s, qi, kj), tirx.exp(load(sf, i) - m_new), tirx.const(0.0, "float32"))
            T.buffer_store(sf, p, [i])
        alpha = regs["a"]
        T.buffer_store(alpha, tirx.exp(load(m, half) - m_new), [half])
        T.buffer_store(m, m_new, [half])
        T.buffer_store(l, load(l, half) * load(alpha, half), [half])
        with T.unroll(0, blocks * 2) as e:
            i = (e // 2) * C_ELEMENTS + 2 * half + e % 2
            T.buffer_store(l, load(l, half) + load(sf, i), [half])
            T.buffer_store(regs["p"], tirx.Cast(s.dtype, load(sf, i)), [i])
        with T.unroll(0, s.head_dim // 8 * 2) as e:
            i = (e // 2) * C_ELEMENTS + 2 * half + e % 2
            T.buffer_store(regs["o"], load(regs["o"], i) * load(alpha, half), [i])


def _fold_sums(regs, ids):
    """Each row's running sum l, folded over the 4 lanes of its quad (each held its own columns')."""
    l = regs["l"]
    with T.unroll(0, 2) as half:
        T.buffer_store(l, _quad(lambda x, y: x + y, load(l, half), ids["warp"]), [half])


def _write(plan, bufs, regs, ids):
    """out[row, col] = acc / l of each of the lane's output elements."""
    l = regs["l"]
    with T.unroll(0, 2) as half:
        _store_output(plan, bufs, regs, ids, half, lambda i, col, half=half: load(regs["o"], i) / load(l, half))


def _store_output(plan, bufs, regs, ids, half, value_of):
    """out[row g (+ 8 `half`), the lane's columns] = value_of(accumulator index, column), where the row exists."""
    s = plan.shape
    qi = ids["row"] + 8 * half
    with T.If(qi < s.q_len):
        with T.Then():
            with T.unroll(0, s.head_dim // 8 * 2) as e:
                i, col = (e // 2) * C_ELEMENTS + 2 * half + e % 2, (e // 2) * 8 + ids["col"] + e % 2
                T.buffer_store(bufs["out"], tirx.Cast(s.dtype, value_of(i, col)), [ids["b"], ids["h"], qi, col])
