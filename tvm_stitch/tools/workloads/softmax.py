"""Softmax over the last axis."""

from .blocks import normal, np_softmax, rows_cols, torch_softmax

DESCRIPTION = "softmax over the last axis"


def relax_graph(rx, dtype, d):
    return rx.function(rx.row_params(dtype, d), lambda bb, x: rx.softmax(bb, x))


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype, 4.0)]


numpy_reference = np_softmax
torch_graph = torch_softmax
