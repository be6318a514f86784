"""Attention chains as transformers' eager attention emits them, with their float64 numpy reference.

`chain(...)` builds `O = softmax(scale Q K^T + mask) V` over (batch, heads,
len, head_dim) tensors in one of two forms: "eager" (the 3-d batched matmuls
between reshapes and broadcast_to views that torch.export gives) or "4d"
(4-d matmuls). KV heads fewer than query heads are repeated as transformers'
`repeat_kv` does (expand_dims, broadcast_to, reshape). Masks: "none",
"causal" (a constant, 0 on and below the diagonal aligned at the end and the
dtype's minimum above, as a decoder's folded mask), "additive" (an input of
shape (batch, 1, 1, kv_len): a padding mask). `symbolic=True` makes the
lengths symbolic sizes (`n` for the query length, `m` for the key length, `n`
for both where they are equal), bounded above by `q_len` and `kv_len`; the
inputs and the reference then take the lengths of a call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax import op

from tvm_stitch.tools.workloads.relax_blocks import function, tensor


@dataclass(frozen=True)
class Chain:
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "float32"
    kv_heads: int = 0  # 0: as many as heads
    mask: str = "none"  # none | causal | additive
    form: str = "eager"  # eager | 4d
    symbolic: bool = False  # the lengths symbolic (q_len and kv_len their upper bounds)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.head_dim))

    def shapes(self, q_len=None, kv_len=None) -> list:
        """The inputs' shapes, at the given lengths (default: q_len and kv_len)."""
        q_len, kv_len = q_len if q_len is not None else self.q_len, kv_len if kv_len is not None else self.kv_len
        q = (self.batch, self.heads, q_len, self.head_dim)
        k = (self.batch, self.kv, kv_len, self.head_dim)
        return [q, k, k] + ([(self.batch, 1, 1, kv_len)] if self.mask == "additive" else [])

    def causal_mask(self, q_len=None, kv_len=None) -> np.ndarray:
        q_len, kv_len = q_len or self.q_len, kv_len or self.kv_len
        i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        low = np.finfo(np.dtype(self.dtype) if self.dtype != "bfloat16" else np.float32).min
        return np.where(j <= i + kv_len - q_len, 0.0, low).astype(np.float32)[None, None]

    def lengths(self) -> tuple:
        """(query length, key length) of the module: ints, or the symbolic sizes."""
        if not self.symbolic:
            return self.q_len, self.kv_len
        if self.mask == "causal":
            raise ValueError("a causal mask constant needs static lengths")
        n = tirx.Var("n", "int64")
        return (n, n) if self.q_len == self.kv_len else (n, tirx.Var("m", "int64"))

    def module(self):
        q_len, kv_len = self.lengths()
        params = [tensor(n, s, self.dtype) for n, s in zip("qkvm", self.shapes(q_len, kv_len))]
        mod = function(params, lambda bb, *args: _body(self, bb, *args))
        if not self.symbolic:
            return mod
        upper = {str(q_len.name): self.q_len, str(kv_len.name): self.kv_len}
        main = mod["main"].with_attrs({"tir_var_lower_bound": {name: 1 for name in upper},
                                       "tir_var_upper_bound": upper})
        return tvm.IRModule({"main": main})

    def inputs(self, rng, q_len=None, kv_len=None) -> list:
        arrays = [rng.standard_normal(s).astype(np.float32) for s in self.shapes(q_len, kv_len)]
        if self.mask == "additive":
            arrays[3] = np.where(rng.random(arrays[3].shape) < 0.2, -1.0e4, 0.0).astype(np.float32)
        return [a.astype(self.dtype) if self.dtype != "bfloat16" else a for a in arrays]

    def reference(self, arrays: list) -> np.ndarray:
        q, k, v = (np.asarray(a, dtype=np.float64) for a in arrays[:3])
        group = self.heads // self.kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if self.mask == "additive":
            s = s + np.asarray(arrays[3], dtype=np.float64)
        if self.mask == "causal":
            s = s + self.causal_mask(q.shape[2], k.shape[2]).astype(np.float64)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        return np.einsum("bhij,bhjd->bhid", p / p.sum(axis=-1, keepdims=True), v)


def _repeat(c: Chain, bb, x):
    if c.kv == c.heads:
        return x
    group, kv_len = c.heads // c.kv, x.ty.shape[2]
    x = bb.emit(op.expand_dims(x, [2]))
    x = bb.emit(op.broadcast_to(x, (c.batch, c.kv, group, kv_len, c.head_dim)))
    return bb.emit(op.reshape(x, (c.batch, c.heads, kv_len, c.head_dim)))


def _bmm(c: Chain, bb, a, b, out_shape):
    """matmul(a, b) of 4-d tensors, as 3-d batched matmuls between views in the eager form."""
    if c.form == "4d":
        return bb.emit(op.matmul(a, b))
    n = c.batch * c.heads
    a3 = bb.emit(op.reshape(bb.emit(op.broadcast_to(a, a.ty.shape)), (n, *a.ty.shape.values[2:])))
    b3 = bb.emit(op.reshape(bb.emit(op.broadcast_to(b, b.ty.shape)), (n, *b.ty.shape.values[2:])))
    return bb.emit(op.reshape(bb.emit(op.matmul(a3, b3)), out_shape))


def _body(c: Chain, bb, q, k, v, mask=None):
    k, v = _repeat(c, bb, k), _repeat(c, bb, v)
    kt = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
    q_len, kv_len = q.ty.shape[2], k.ty.shape[2]
    s = _bmm(c, bb, q, kt, (c.batch, c.heads, q_len, kv_len))
    s = bb.emit(op.multiply(s, relax.const(c.scale, c.dtype)))
    if c.mask == "causal":
        s = bb.emit(op.add(s, relax.const(c.causal_mask().astype(c.dtype) if c.dtype != "bfloat16"
                                          else c.causal_mask(), c.dtype)))
    if mask is not None:
        s = bb.emit(op.add(s, mask))
    p = bb.emit(op.nn.softmax(s, axis=-1))
    return _bmm(c, bb, p, v, (c.batch, c.heads, q_len, c.head_dim))
