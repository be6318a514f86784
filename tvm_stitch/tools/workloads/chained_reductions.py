"""sum, max, min chained over the same rows."""

import numpy as np

from .blocks import normal, rows_cols

DESCRIPTION = "sum, max, min chained over the same rows"


def relax_graph(rx, dtype, d):
    def body(bb, x):
        op, c = rx.op, rx.const
        s = bb.emit(op.sum(x, axis=[-1], keepdims=True))
        centered = bb.emit(op.subtract(x, op.divide(s, c(float(d["cols"]), dtype))))
        mx = bb.emit(op.max(op.abs(centered), axis=[-1], keepdims=True))
        scaled = bb.emit(op.divide(centered, op.add(mx, c(1.0, dtype))))
        mn = bb.emit(op.min(scaled, axis=[-1], keepdims=True))
        return bb.emit(op.subtract(scaled, mn))

    return rx.function(rx.row_params(dtype, d), body)


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype)]


def numpy_reference(x):
    centered = x - x.sum(-1, keepdims=True) / x.shape[-1]
    scaled = centered / (np.abs(centered).max(-1, keepdims=True) + 1.0)
    return scaled - scaled.min(-1, keepdims=True)


def torch_graph(x):
    centered = x - x.sum(-1, keepdim=True) / x.shape[-1]
    scaled = centered / (centered.abs().amax(-1, keepdim=True) + 1.0)
    return scaled - scaled.amin(-1, keepdim=True)
