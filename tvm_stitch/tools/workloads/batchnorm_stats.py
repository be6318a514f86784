"""BatchNorm training statistics over N, H, W (NCHW)."""

from .blocks import normal

DESCRIPTION = "BatchNorm training statistics over N, H, W (NCHW)"
DTYPES = ("float32",)


def _shape(d):
    return (d["batch"], d["heads"] * 16, d["seq"] // 4, d["seq"] // 4)


def relax_graph(rx, dtype, d):
    def body(bb, x):
        op = rx.op
        mean = bb.emit(op.mean(x, axis=[0, 2, 3], keepdims=True))
        centered = bb.emit(op.subtract(x, mean))
        var = bb.emit(op.mean(op.multiply(centered, centered), axis=[0, 2, 3], keepdims=True))
        return rx.Tuple([mean, var])

    return rx.function([rx.tensor("x", _shape(d), dtype)], body)


def inputs(rng, dtype, d):
    return [normal(rng, _shape(d), dtype)]


def numpy_reference(x):
    return x.mean((0, 2, 3), keepdims=True), x.var((0, 2, 3), keepdims=True)


def torch_graph(x):
    mean = x.mean((0, 2, 3), keepdim=True)
    return mean, ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
