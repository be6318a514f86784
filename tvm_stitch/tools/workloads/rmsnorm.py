"""RMSNorm (LLaMA)."""

import numpy as np

from .blocks import normal, rows_cols

DESCRIPTION = "RMSNorm (LLaMA)"


def relax_graph(rx, dtype, d):
    def body(bb, x, w):
        op = rx.op
        ms = bb.emit(op.mean(op.multiply(x, x), axis=[-1], keepdims=True))
        r = bb.emit(op.rsqrt(op.add(ms, rx.const(1e-6, dtype))))
        return bb.emit(op.multiply(op.multiply(x, r), w))

    return rx.function(rx.row_params(dtype, d, "weight"), body)


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def torch_graph(x, w):
    return x * ((x * x).mean(-1, keepdim=True) + 1e-6).rsqrt() * w
