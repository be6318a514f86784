"""Bias add + GELU (erf form)."""

import numpy as np

from .blocks import normal, np_erf, rows_cols

DESCRIPTION = "bias add + GELU (erf form)"


def relax_graph(rx, dtype, d):
    def body(bb, x, b):
        op = rx.op
        h = bb.emit(op.add(x, b))
        inner = bb.emit(op.erf(op.multiply(h, rx.const(0.7071067811865476, dtype))))
        return bb.emit(op.multiply(op.multiply(h, rx.const(0.5, dtype)), op.add(inner, rx.const(1.0, dtype))))

    return rx.function(rx.row_params(dtype, d, "bias"), body)


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, b):
    return 0.5 * (x + b) * (1.0 + np_erf((x + b) / np.sqrt(2.0)))


def torch_graph(x, b):
    return (x + b) * 0.5 * (((x + b) * 0.7071067811865476).erf() + 1.0)
