"""The built-in suite of memory-intensive graphs, with inputs and numpy references.

Every graph is written the way frontends emit it: decomposed into primitive
Relax ops (mean, subtract, rsqrt, exp, ...), not as fused library ops.
`SUITE` maps a name to a `SuiteGraph`; `build(dtype, size)` gives the Relax
module at the benchmark size ("bench") or a small one ("test").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import relax

from tvm_stitch.tools.suite_data import DATA, SIZES, VARIANTS, dims, reference_of, variant_dims

__all__ = ["SUITE", "SIZES", "SuiteGraph", "dims", "reference"]


@dataclass(frozen=True)
class SuiteGraph:
    name: str
    description: str
    build: Callable  # (dtype, dims) -> IRModule
    inputs: Callable  # (rng, dtype, dims) -> list of numpy arrays
    reference: Callable  # (inputs as float64) -> numpy array or tuple
    dtypes: tuple = ("float32", "float16")


def _fn(params: list, body: Callable) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = body(bb, *params)
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _t(name: str, shape, dtype: str) -> relax.Var:
    return relax.Var(name, relax.TensorType(tuple(shape), dtype))


def _c(value: float, dtype: str) -> relax.Constant:
    return relax.const(value, dtype)


# --- Relax building blocks, decomposed as a frontend writes them -----------------

def _layernorm(bb, x, gamma, beta, dtype, eps=1e-5):
    op = relax.op
    mean = bb.emit(op.mean(x, axis=[-1], keepdims=True))
    xc = bb.emit(op.subtract(x, mean))
    var = bb.emit(op.mean(op.multiply(xc, xc), axis=[-1], keepdims=True))
    rstd = bb.emit(op.rsqrt(op.add(var, _c(eps, dtype))))
    y = bb.emit(op.multiply(xc, rstd))
    return bb.emit(op.add(op.multiply(y, gamma), beta)), mean, rstd


def _softmax(bb, x):
    op = relax.op
    mx = bb.emit(op.max(x, axis=[-1], keepdims=True))
    e = bb.emit(op.exp(op.subtract(x, mx)))
    s = bb.emit(op.sum(e, axis=[-1], keepdims=True))
    return bb.emit(op.divide(e, s))


# --- numpy references (float64) ---------------------------------------------------


# --- the graphs ---------------------------------------------------------------------

def _layernorm_graph(dtype, d):
    x, g, b = _t("x", (d["rows"], d["cols"]), dtype), _t("gamma", (d["cols"],), dtype), _t("beta", (d["cols"],), dtype)
    return _fn([x, g, b], lambda bb, x, g, b: _layernorm(bb, x, g, b, dtype)[0])


def _layernorm_stats_graph(dtype, d):
    x, g, b = _t("x", (d["rows"], d["cols"]), dtype), _t("gamma", (d["cols"],), dtype), _t("beta", (d["cols"],), dtype)

    def body(bb, x, g, b):
        y, mean, rstd = _layernorm(bb, x, g, b, dtype)
        return relax.Tuple([y, mean, rstd])

    return _fn([x, g, b], body)


def _rmsnorm_graph(dtype, d):
    x, w = _t("x", (d["rows"], d["cols"]), dtype), _t("weight", (d["cols"],), dtype)

    def body(bb, x, w):
        op = relax.op
        ms = bb.emit(op.mean(op.multiply(x, x), axis=[-1], keepdims=True))
        r = bb.emit(op.rsqrt(op.add(ms, _c(1e-6, dtype))))
        return bb.emit(op.multiply(op.multiply(x, r), w))

    return _fn([x, w], body)


def _softmax_graph(dtype, d):
    x = _t("x", (d["rows"], d["cols"]), dtype)
    return _fn([x], lambda bb, x: _softmax(bb, x))


def _attention_softmax_graph(dtype, d):
    s = (d["batch"], d["heads"], d["seq"], d["seq"])
    scores, mask = _t("scores", s, dtype), _t("mask", (d["batch"], 1, 1, d["seq"]), dtype)

    def body(bb, scores, mask):
        op = relax.op
        scaled = bb.emit(op.add(op.multiply(scores, _c(0.125, dtype)), mask))
        return _softmax(bb, scaled)

    return _fn([scores, mask], body)


def _bias_gelu_graph(dtype, d):
    x, b = _t("x", (d["rows"], d["cols"]), dtype), _t("bias", (d["cols"],), dtype)

    def body(bb, x, b):
        op = relax.op
        h = bb.emit(op.add(x, b))
        inner = bb.emit(op.erf(op.multiply(h, _c(0.7071067811865476, dtype))))
        return bb.emit(op.multiply(op.multiply(h, _c(0.5, dtype)), op.add(inner, _c(1.0, dtype))))

    return _fn([x, b], body)


def _residual_layernorm_graph(dtype, d):
    shape = (d["rows"], d["cols"])
    x, r = _t("x", shape, dtype), _t("residual", shape, dtype)
    g, b = _t("gamma", (d["cols"],), dtype), _t("beta", (d["cols"],), dtype)

    def body(bb, x, r, g, b):
        h = bb.emit(relax.op.add(x, r))
        y = _layernorm(bb, h, g, b, dtype)[0]
        return relax.Tuple([h, y])

    return _fn([x, r, g, b], body)


def _layernorm_softmax_graph(dtype, d):
    x, g, b = _t("x", (d["rows"], d["cols"]), dtype), _t("gamma", (d["cols"],), dtype), _t("beta", (d["cols"],), dtype)
    return _fn([x, g, b], lambda bb, x, g, b: _softmax(bb, _layernorm(bb, x, g, b, dtype)[0]))


def _cross_entropy_graph(dtype, d):
    logits, labels = _t("logits", (d["rows"], d["vocab"]), dtype), _t("labels", (d["rows"],), "int64")

    def body(bb, logits, labels):
        op = relax.op
        mx = bb.emit(op.max(logits, axis=[-1], keepdims=True))
        shifted = bb.emit(op.subtract(logits, mx))
        lse = bb.emit(op.log(op.sum(op.exp(shifted), axis=[-1], keepdims=True)))
        logp = bb.emit(op.subtract(shifted, lse))
        return bb.emit(op.nn.nll_loss(logp, labels, reduction="mean"))

    return _fn([logits, labels], body)


def _chained_reductions_graph(dtype, d):
    x = _t("x", (d["rows"], d["cols"]), dtype)

    def body(bb, x):
        op = relax.op
        s = bb.emit(op.sum(x, axis=[-1], keepdims=True))
        centered = bb.emit(op.subtract(x, op.divide(s, _c(float(d["cols"]), dtype))))
        mx = bb.emit(op.max(op.abs(centered), axis=[-1], keepdims=True))
        scaled = bb.emit(op.divide(centered, op.add(mx, _c(1.0, dtype))))
        mn = bb.emit(op.min(scaled, axis=[-1], keepdims=True))
        return bb.emit(op.subtract(scaled, mn))

    return _fn([x], body)


def _layernorm_backward_graph(dtype, d):
    shape = (d["rows"], d["cols"])
    x, dy = _t("x", shape, dtype), _t("dy", shape, dtype)
    mean, rstd, g = _t("mean", (d["rows"], 1), dtype), _t("rstd", (d["rows"], 1), dtype), _t("gamma", (d["cols"],), dtype)

    def body(bb, x, dy, mean, rstd, g):
        op = relax.op
        xhat = bb.emit(op.multiply(op.subtract(x, mean), rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0]))
        dbeta = bb.emit(op.sum(dy, axis=[0]))
        dxhat = bb.emit(op.multiply(dy, g))
        m1 = bb.emit(op.mean(dxhat, axis=[-1], keepdims=True))
        m2 = bb.emit(op.mean(op.multiply(dxhat, xhat), axis=[-1], keepdims=True))
        dx = bb.emit(op.multiply(rstd, op.subtract(op.subtract(dxhat, m1), op.multiply(xhat, m2))))
        return relax.Tuple([dx, dgamma, dbeta])

    return _fn([x, dy, mean, rstd, g], body)


def _batchnorm_stats_graph(dtype, d):
    n, c, hw = d["batch"], d["heads"] * 16, d["seq"] // 4
    x = _t("x", (n, c, hw, hw), dtype)

    def body(bb, x):
        op = relax.op
        mean = bb.emit(op.mean(x, axis=[0, 2, 3], keepdims=True))
        centered = bb.emit(op.subtract(x, mean))
        var = bb.emit(op.mean(op.multiply(centered, centered), axis=[0, 2, 3], keepdims=True))
        return relax.Tuple([mean, var])

    return _fn([x], body)


def _adam_graph(dtype, d, tensors=12):
    shapes = [(d["cols"] * (1 + i % 3), d["cols"] // (1 + i % 2)) for i in range(tensors)]
    params = []
    for i, shape in enumerate(shapes):
        params += [_t(f"p{i}", shape, dtype), _t(f"g{i}", shape, dtype), _t(f"m{i}", shape, dtype), _t(f"v{i}", shape, dtype)]

    def body(bb, *args):
        op = relax.op
        outs = []
        for i in range(tensors):
            p, g, m, v = args[4 * i: 4 * i + 4]
            m_new = bb.emit(op.add(op.multiply(m, _c(0.9, dtype)), op.multiply(g, _c(0.1, dtype))))
            v_new = bb.emit(op.add(op.multiply(v, _c(0.999, dtype)), op.multiply(op.multiply(g, g), _c(0.001, dtype))))
            step = bb.emit(op.divide(m_new, op.add(op.sqrt(v_new), _c(1e-8, dtype))))
            outs += [bb.emit(op.subtract(p, op.multiply(step, _c(1e-3, dtype)))), m_new, v_new]
        return relax.Tuple(outs)

    return _fn(params, body)


BUILDERS = {
    "layernorm": _layernorm_graph,
    "layernorm_stats": _layernorm_stats_graph,
    "rmsnorm": _rmsnorm_graph,
    "softmax": _softmax_graph,
    "attention_softmax": _attention_softmax_graph,
    "bias_gelu": _bias_gelu_graph,
    "residual_layernorm": _residual_layernorm_graph,
    "layernorm_softmax": _layernorm_softmax_graph,
    "cross_entropy": _cross_entropy_graph,
    "layernorm_backward": _layernorm_backward_graph,
    "batchnorm_stats": _batchnorm_stats_graph,
    "adam_update": _adam_graph,
    "chained_reductions": _chained_reductions_graph,
}

BUILDERS.update({
    name: (lambda base, keys: lambda dtype, d: BUILDERS[base](dtype, variant_dims(d, keys)))(base, keys)
    for name, (base, keys) in VARIANTS.items()
})

SUITE = {
    name: SuiteGraph(name, d.description, BUILDERS[name], d.inputs, d.reference, d.dtypes)
    for name, d in DATA.items()
}


def reference(graph: SuiteGraph, inputs: list) -> list:
    """numpy reference outputs in float64, as a list."""
    return reference_of(graph.reference, inputs)
