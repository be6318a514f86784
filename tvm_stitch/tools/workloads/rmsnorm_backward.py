"""RMSNorm backward: dx (a row reduction), dgamma (a column reduction). Outside the suite's graphs
(tools/norm_backward_graphs.py builds it)."""

import numpy as np

from .blocks import normal, rows_cols

DESCRIPTION = "RMSNorm backward: dx (a row reduction), dgamma (column)"
DTYPES = ("float32",)


def relax_graph(rx, dtype, d):
    shape = rows_cols(d)
    params = [rx.tensor("x", shape, dtype), rx.tensor("dy", shape, dtype), rx.tensor("rstd", (d["rows"], 1), dtype),
              rx.tensor("gamma", (d["cols"],), dtype)]

    def body(bb, x, dy, rstd, g):
        op = rx.op
        xhat = bb.emit(op.multiply(x, rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0]))
        dxhat = bb.emit(op.multiply(dy, g))
        m = bb.emit(op.mean(op.multiply(dxhat, xhat), axis=[-1], keepdims=True))
        dx = bb.emit(op.multiply(rstd, op.subtract(dxhat, op.multiply(xhat, m))))
        return rx.Tuple([dx, dgamma])

    return rx.function(params, body)


def inputs(rng, dtype, d):
    x = normal(rng, rows_cols(d), dtype)
    rstd = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    return [x, normal(rng, rows_cols(d), dtype), rstd.astype(dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, dy, rstd, g):
    xhat = x * rstd
    dxhat = dy * g
    return rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True)), (dy * xhat).sum(0)


def torch_graph(x, dy, rstd, g):
    xhat = x * rstd
    dxhat = dy * g
    return rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)), (dy * xhat).sum(0)
