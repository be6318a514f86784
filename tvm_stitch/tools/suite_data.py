"""Inputs and numpy references of the suite graphs: numpy only, no TVM.

Kept apart from the Relax builders (suite.py) so that the GPU check kit can
regenerate inputs and references on a machine that has only TVM's runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import erf
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class GraphData:
    description: str
    inputs: Callable  # (rng, dtype, dims) -> list of numpy arrays
    reference: Callable  # (inputs as float64) -> numpy array or tuple
    dtypes: tuple = ("float32", "float16")

SIZES = {
    # rows x columns of the main input per size class; short_*, long_*, bn_*: the shape variants
    "bench": {"rows": 4096, "cols": 768, "batch": 8, "heads": 12, "seq": 128, "vocab": 8192,
              "short_rows": 750000, "short_cols": 32, "long_rows": 64, "long_cols": 30000,
              "bn_batch": 32, "bn_heads": 4, "bn_seq": 224},
    "test": {"rows": 64, "cols": 96, "batch": 2, "heads": 3, "seq": 16, "vocab": 200,
             "short_rows": 300, "short_cols": 32, "long_rows": 4, "long_cols": 3000,
             "bn_batch": 2, "bn_heads": 1, "bn_seq": 20},
}

# Shape variants: a suite graph with some of its dims taken from other keys of the size class.
VARIANTS = {
    "softmax_short_rows": ("softmax", {"rows": "short_rows", "cols": "short_cols"}),
    "softmax_long_rows": ("softmax", {"rows": "long_rows", "cols": "long_cols"}),
    "layernorm_backward_short_rows": ("layernorm_backward", {"rows": "short_rows", "cols": "short_cols"}),
    "batchnorm_stats_resnet": ("batchnorm_stats", {"batch": "bn_batch", "heads": "bn_heads", "seq": "bn_seq"}),
}


def dims(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, not {size!r}")
    return SIZES[size]


def _np_layernorm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean) * rstd * g + b, mean, rstd


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _erf(x):
    return np.vectorize(erf)(x)


def _np_layernorm_backward(x, dy, mean, rstd, g):
    xhat = (x - mean) * rstd
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


def _layernorm_backward_inputs(rng, dt, d):
    x = _normal(rng, _rows_cols(d), dt)
    mean = x.astype(np.float64).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.astype(np.float64).var(-1, keepdims=True) + 1e-5)
    return [x, _normal(rng, _rows_cols(d), dt), mean.astype(dt), rstd.astype(dt), _normal(rng, (d["cols"],), dt)]


def _np_adam(*args):
    outs = []
    for i in range(len(args) // 4):
        p, g, m, v = args[4 * i: 4 * i + 4]
        m_new = 0.9 * m + 0.1 * g
        v_new = 0.999 * v + 0.001 * g * g
        outs += [p - 1e-3 * m_new / (np.sqrt(v_new) + 1e-8), m_new, v_new]
    return tuple(outs)


def _adam_inputs(rng, dt, d):
    arrays = []
    for i in range(12):
        shape = (d["cols"] * (1 + i % 3), d["cols"] // (1 + i % 2))
        arrays += [_normal(rng, shape, dt), _normal(rng, shape, dt), _normal(rng, shape, dt),
                   np.abs(_normal(rng, shape, dt))]
    return arrays


def _np_chained(x):
    cols = x.shape[-1]
    centered = x - x.sum(-1, keepdims=True) / cols
    scaled = centered / (np.abs(centered).max(-1, keepdims=True) + 1.0)
    return scaled - scaled.min(-1, keepdims=True)


def _np_cross_entropy(logits, labels):
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.array(-logp[np.arange(len(labels)), labels.astype(np.int64)].mean())


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _rows_cols(d):
    return (d["rows"], d["cols"])



DATA = {
    "layernorm": GraphData(
        "decomposed LayerNorm over the last axis",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, (d["cols"],), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, g, b: _np_layernorm(x, g, b)[0],
    ),
    "layernorm_stats": GraphData(
        "LayerNorm returning y, mean and rstd (multiple outputs)",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, (d["cols"],), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, g, b: _np_layernorm(x, g, b),
        dtypes=("float32",),
    ),
    "rmsnorm": GraphData(
        "RMSNorm (LLaMA)",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w,
    ),
    "softmax": GraphData(
        "softmax over the last axis",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt, 4.0)],
        _np_softmax,
    ),
    "attention_softmax": GraphData(
        "attention scores: scale, additive mask, softmax",
        lambda rng, dt, d: [
        _normal(rng, (d["batch"], d["heads"], d["seq"], d["seq"]), dt, 4.0),
        np.where(rng.random((d["batch"], 1, 1, d["seq"])) < 0.2, -1e4, 0.0).astype(dt),
        ],
        lambda s, m: _np_softmax(s * 0.125 + m),
    ),
    "bias_gelu": GraphData(
        "bias add + GELU (erf form)",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, b: 0.5 * (x + b) * (1.0 + _erf((x + b) / np.sqrt(2.0))),
    ),
    "residual_layernorm": GraphData(
        "residual add + LayerNorm, returning both",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, _rows_cols(d), dt),
        _normal(rng, (d["cols"],), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, r, g, b: (x + r, _np_layernorm(x + r, g, b)[0]),
    ),
    "layernorm_softmax": GraphData(
        "LayerNorm followed by softmax (4 chained row reductions)",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt), _normal(rng, (d["cols"],), dt), _normal(rng, (d["cols"],), dt)],
        lambda x, g, b: _np_softmax(_np_layernorm(x, g, b)[0]),
    ),
    "cross_entropy": GraphData(
        "log-softmax + NLL with a mean loss",
        lambda rng, dt, d: [_normal(rng, (d["rows"], d["vocab"]), dt, 2.0),
        rng.integers(0, d["vocab"], d["rows"]).astype("int64")],
        _np_cross_entropy,
        dtypes=("float32",),
    ),
    "layernorm_backward": GraphData(
        "LayerNorm backward: dx (row reductions), dgamma and dbeta (column)",
        _layernorm_backward_inputs, _np_layernorm_backward,
        dtypes=("float32",),
    ),
    "batchnorm_stats": GraphData(
        "BatchNorm training statistics over N, H, W (NCHW)",
        lambda rng, dt, d: [_normal(rng, (d["batch"], d["heads"] * 16, d["seq"] // 4, d["seq"] // 4), dt)],
        lambda x: (x.mean((0, 2, 3), keepdims=True), x.var((0, 2, 3), keepdims=True)),
        dtypes=("float32",),
    ),
    "adam_update": GraphData(
        "Adam step over 12 parameter tensors (independent element-wise chains)",
        _adam_inputs, _np_adam,
        dtypes=("float32",),
    ),
    "chained_reductions": GraphData(
        "sum, max, min chained over the same rows",
        lambda rng, dt, d: [_normal(rng, _rows_cols(d), dt)],
        _np_chained,
    ),
}


def variant_dims(d: dict, keys: dict) -> dict:
    """The dims of a shape variant: d with each key of `keys` set to d[keys[key]]."""
    return dict(d, **{key: d[source] for key, source in keys.items()})


def _variant(base: GraphData, keys: dict) -> GraphData:
    shape = ", ".join(f"{k} from {v}" for k, v in keys.items())
    return GraphData(f"{base.description} ({shape})",
                     lambda rng, dt, d: base.inputs(rng, dt, variant_dims(d, keys)), base.reference, base.dtypes)


DATA.update({name: _variant(DATA[base], keys) for name, (base, keys) in VARIANTS.items()})


def reference_of(fn, inputs: list) -> list:
    """numpy reference outputs in float64, as a list."""
    as64 = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in inputs]
    out = fn(*as64)
    return list(out) if isinstance(out, tuple) else [out]
