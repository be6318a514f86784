"""Decomposed LayerNorm over the last axis."""

from .blocks import normal, np_layernorm, rows_cols, torch_layernorm

DESCRIPTION = "decomposed LayerNorm over the last axis"


def relax_graph(rx, dtype, d):
    return rx.function(rx.row_params(dtype, d, "gamma", "beta"),
                       lambda bb, x, g, b: rx.layernorm(bb, x, g, b, dtype)[0])


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype), normal(rng, (d["cols"],), dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, g, b):
    return np_layernorm(x, g, b)[0]


def torch_graph(x, g, b):
    return torch_layernorm(x, g, b)[0]
