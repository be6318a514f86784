"""LayerNorm returning y, mean and rstd (multiple outputs)."""

from . import layernorm
from .blocks import np_layernorm, torch_layernorm

DESCRIPTION = "LayerNorm returning y, mean and rstd (multiple outputs)"
DTYPES = ("float32",)
inputs = layernorm.inputs


def relax_graph(rx, dtype, d):
    def body(bb, x, g, b):
        return rx.Tuple(list(rx.layernorm(bb, x, g, b, dtype)))

    return rx.function(rx.row_params(dtype, d, "gamma", "beta"), body)


def numpy_reference(x, g, b):
    return np_layernorm(x, g, b)


def torch_graph(x, g, b):
    return torch_layernorm(x, g, b)
