"""BatchNorm backward (NCHW, training): per channel, sums over N, H, W of dy and dy * xhat (dbeta,
dgamma), then dx from both. Outside the suite's graphs (tools/norm_backward_graphs.py builds it)."""

import numpy as np

from .blocks import normal

DESCRIPTION = "BatchNorm backward (NCHW): dgamma, dbeta (sums over N, H, W), dx from them"
DTYPES = ("float32",)


def _shape(d):
    return (d["batch"], d["channels"], d["height"], d["width"])


def relax_graph(rx, dtype, d):
    n, c, h, w = _shape(d)
    params = [rx.tensor("x", _shape(d), dtype), rx.tensor("dy", _shape(d), dtype),
              rx.tensor("mean", (1, c, 1, 1), dtype), rx.tensor("rstd", (1, c, 1, 1), dtype),
              rx.tensor("gamma", (1, c, 1, 1), dtype)]

    def body(bb, x, dy, mean, rstd, g):
        op = rx.op
        xhat = bb.emit(op.multiply(op.subtract(x, mean), rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0, 2, 3], keepdims=True))
        dbeta = bb.emit(op.sum(dy, axis=[0, 2, 3], keepdims=True))
        scale = bb.emit(op.multiply(g, rstd))
        count = rx.const(1.0 / (n * h * w), dtype)
        centred = op.subtract(op.subtract(dy, op.multiply(dbeta, count)), op.multiply(xhat, op.multiply(dgamma, count)))
        dx = bb.emit(op.multiply(scale, centred))
        return rx.Tuple([dx, op.reshape(dgamma, (c,)), op.reshape(dbeta, (c,))])

    return rx.function(params, body)


def inputs(rng, dtype, d):
    x = normal(rng, _shape(d), dtype)
    mean = x.astype(np.float64).mean((0, 2, 3), keepdims=True)
    rstd = 1.0 / np.sqrt(x.astype(np.float64).var((0, 2, 3), keepdims=True) + 1e-5)
    return [x, normal(rng, _shape(d), dtype), mean.astype(dtype), rstd.astype(dtype),
            normal(rng, (1, _shape(d)[1], 1, 1), dtype)]


def _backward(x, dy, mean, rstd, g, channel_sums):
    """The formula, for numpy arrays or torch tensors (`channel_sums`: their sum over N, H, W, kept)."""
    xhat = (x - mean) * rstd
    dgamma = channel_sums(dy * xhat)
    dbeta = channel_sums(dy)
    count = x.shape[0] * x.shape[2] * x.shape[3]
    dx = g * rstd * (dy - dbeta / count - xhat * dgamma / count)
    return dx, dgamma.reshape(-1), dbeta.reshape(-1)


def numpy_reference(x, dy, mean, rstd, g):
    return _backward(x, dy, mean, rstd, g, lambda t: t.sum((0, 2, 3), keepdims=True))


def torch_graph(x, dy, mean, rstd, g):
    return _backward(x, dy, mean, rstd, g, lambda t: t.sum((0, 2, 3), keepdim=True))
