"""The Relax toolkit handed to each suite graph's `relax_graph`: ops decomposed as frontends emit them."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

op = relax.op
Tuple = relax.Tuple


def function(params: list, body: Callable) -> tvm.IRModule:
    """A module whose main takes `params` and returns body(bb, *params), inside one dataflow block."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def tensor(name: str, shape, dtype: str) -> relax.Var:
    return relax.Var(name, relax.TensorType(tuple(shape), dtype))


def const(value: float, dtype: str) -> relax.Constant:
    return relax.const(value, dtype)


def layernorm(bb, x, gamma, beta, dtype, eps=1e-5):
    """(y, mean, rstd) of a LayerNorm over the last axis."""
    mean = bb.emit(op.mean(x, axis=[-1], keepdims=True))
    xc = bb.emit(op.subtract(x, mean))
    var = bb.emit(op.mean(op.multiply(xc, xc), axis=[-1], keepdims=True))
    rstd = bb.emit(op.rsqrt(op.add(var, const(eps, dtype))))
    y = bb.emit(op.multiply(xc, rstd))
    return bb.emit(op.add(op.multiply(y, gamma), beta)), mean, rstd


def softmax(bb, x):
    mx = bb.emit(op.max(x, axis=[-1], keepdims=True))
    e = bb.emit(op.exp(op.subtract(x, mx)))
    s = bb.emit(op.sum(e, axis=[-1], keepdims=True))
    return bb.emit(op.divide(e, s))


def row_params(dtype: str, d: dict, *vectors: str) -> list:
    """x of (rows, cols) and one (cols,) vector per name in `vectors`."""
    return [tensor("x", (d["rows"], d["cols"]), dtype)] + [tensor(v, (d["cols"],), dtype) for v in vectors]
