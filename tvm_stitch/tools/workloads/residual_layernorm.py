"""Residual add + LayerNorm, returning both."""

from .blocks import normal, np_layernorm, rows_cols, torch_layernorm

DESCRIPTION = "residual add + LayerNorm, returning both"


def relax_graph(rx, dtype, d):
    shape = rows_cols(d)
    params = [rx.tensor("x", shape, dtype), rx.tensor("residual", shape, dtype),
              rx.tensor("gamma", (d["cols"],), dtype), rx.tensor("beta", (d["cols"],), dtype)]

    def body(bb, x, r, g, b):
        h = bb.emit(rx.op.add(x, r))
        y = rx.layernorm(bb, h, g, b, dtype)[0]
        return rx.Tuple([h, y])

    return rx.function(params, body)


def inputs(rng, dtype, d):
    return [normal(rng, rows_cols(d), dtype), normal(rng, rows_cols(d), dtype),
            normal(rng, (d["cols"],), dtype), normal(rng, (d["cols"],), dtype)]


def numpy_reference(x, r, g, b):
    return x + r, np_layernorm(x + r, g, b)[0]


def torch_graph(x, r, g, b):
    return x + r, torch_layernorm(x + r, g, b)[0]
