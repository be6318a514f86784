"""Attention chains as transformers' eager attention emits them, with their float64 numpy reference.

`chain(...)` builds `O = softmax(scale Q K^T + mask) V` over (batch, heads,
len, head_dim) tensors in one of two forms: "eager" (the 3-d batched matmuls
between reshapes and broadcast_to views that torch.export gives) or "4d"
(4-d matmuls). KV heads fewer than query heads are repeated as transformers'
`repeat_kv` does (expand_dims, broadcast_to, reshape). Masks: "none",
"causal" (a constant, 0 on and below the diagonal aligned at the end and the
dtype's minimum above, as a decoder's folded mask), "additive" (an input of
shape (batch, 1, 1, kv_len): a padding mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
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

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.head_dim))

    def shapes(self) -> list:
        q = (self.batch, self.heads, self.q_len, self.head_dim)
        k = (self.batch, self.kv, self.kv_len, self.head_dim)
        return [q, k, k] + ([(self.batch, 1, 1, self.kv_len)] if self.mask == "additive" else [])

    def causal_mask(self) -> np.ndarray:
        i, j = np.arange(self.q_len)[:, None], np.arange(self.kv_len)[None, :]
        low = np.finfo(np.dtype(self.dtype) if self.dtype != "bfloat16" else np.float32).min
        return np.where(j <= i + self.kv_len - self.q_len, 0.0, low).astype(np.float32)[None, None]

    def module(self):
        params = [tensor(n, s, self.dtype) for n, s in zip("qkvm", self.shapes())]
        return function(params, lambda bb, *args: _body(self, bb, *args))

    def inputs(self, rng) -> list:
        arrays = [rng.standard_normal(s).astype(np.float32) for s in self.shapes()]
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
            s = s + self.causal_mask().astype(np.float64)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        return np.einsum("bhij,bhjd->bhid", p / p.sum(axis=-1, keepdims=True), v)


def _repeat(c: Chain, bb, x):
    if c.kv == c.heads:
        return x
    group = c.heads // c.kv
    x = bb.emit(op.expand_dims(x, [2]))
    x = bb.emit(op.broadcast_to(x, (c.batch, c.kv, group, c.kv_len, c.head_dim)))
    return bb.emit(op.reshape(x, (c.batch, c.heads, c.kv_len, c.head_dim)))


def _bmm(c: Chain, bb, a, b, out_shape):
    """matmul(a, b) of 4-d tensors, as 3-d batched matmuls between views in the eager form."""
    if c.form == "4d":
        return bb.emit(op.matmul(a, b))
    n = c.batch * c.heads
    a3 = bb.emit(op.reshape(bb.emit(op.broadcast_to(a, a.ty.shape)), (n, *[int(d) for d in a.ty.shape][2:])))
    b3 = bb.emit(op.reshape(bb.emit(op.broadcast_to(b, b.ty.shape)), (n, *[int(d) for d in b.ty.shape][2:])))
    return bb.emit(op.reshape(bb.emit(op.matmul(a3, b3)), out_shape))


def _body(c: Chain, bb, q, k, v, mask=None):
    k, v = _repeat(c, bb, k), _repeat(c, bb, v)
    kt = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
    s = _bmm(c, bb, q, kt, (c.batch, c.heads, c.q_len, c.kv_len))
    s = bb.emit(op.multiply(s, relax.const(c.scale, c.dtype)))
    if c.mask == "causal":
        s = bb.emit(op.add(s, relax.const(c.causal_mask().astype(c.dtype) if c.dtype != "bfloat16"
                                          else c.causal_mask(), c.dtype)))
    if mask is not None:
        s = bb.emit(op.add(s, mask))
    p = bb.emit(op.nn.softmax(s, axis=-1))
    return _bmm(c, bb, p, v, (c.batch, c.heads, c.q_len, c.head_dim))
