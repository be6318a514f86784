"""LayerNorm followed by softmax (4 chained row reductions)."""

from . import layernorm
from .blocks import np_layernorm, np_softmax, torch_layernorm, torch_softmax

DESCRIPTION = "LayerNorm followed by softmax (4 chained row reductions)"
inputs = layernorm.inputs


def relax_graph(rx, dtype, d):
    return rx.function(rx.row_params(dtype, d, "gamma", "beta"),
                       lambda bb, x, g, b: rx.softmax(bb, rx.layernorm(bb, x, g, b, dtype)[0]))


def numpy_reference(x, g, b):
    return np_softmax(np_layernorm(x, g, b)[0])


def torch_graph(x, g, b):
    return torch_softmax(torch_layernorm(x, g, b)[0])
