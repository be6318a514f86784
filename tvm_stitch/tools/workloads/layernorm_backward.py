"""LayerNorm backward: dx (row reductions), dgamma and dbeta (column reductions)."""

import numpy as np

from .blocks import normal, rows_cols

DESCRIPTION = "LayerNorm backward: dx (row reductions), dgamma and dbeta (column)"
DTYPES = ("float32",)


def relax_graph(rx, dtype, d):
    shape = rows_cols(d)
    params = [rx.tensor("x", shape, dtype), rx.tensor("dy", shape, dtype), rx.tensor("mean", (d["rows"], 1), dtype),
              rx.tensor("rstd", (d["rows"], 1), dtype), rx.tensor("gamma", (d["cols"],), dtype)]

    def body(bb, x, dy, mean, rstd, g):
        op = rx.op
        xhat = bb.emit(op.multiply(op.subtract(x, mean), rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0]))
        dbeta = bb.emit(op.sum(dy, axis=[0]))
        dxhat = bb.emit(op.multiply(dy, g))
        m1 = bb.emit(op.mean(dxhat, axis=[-1], keepdims=True))
        m2 = bb.emit(op.mean(op.multiply(dxhat, xhat), axis=[-1], keepdims=True))
        dx = bb.emit(op.multiply(rstd, op.subtract(op.subtract(dxhat, m1), op.multiply(xhat, m2))))
        return rx.Tuple([dx, dgamma, dbeta])

    return rx.function(params, body)


def inputs(rng, dtype, d):
    x = normal(rng, rows_cols(d), dtype)
    mean = x.astype(np.float64).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.astype(np.float64).var(-1, keepdims=True) + 1e-5)
    return [x, normal(rng, rows_cols(d), dtype), mean.astype(dtype), rstd.astype(dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, dy, mean, rstd, g):
    xhat = (x - mean) * rstd
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


def torch_graph(x, dy, mean, rstd, g):
    xhat = (x - mean) * rstd
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)
