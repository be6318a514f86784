"""Building blocks of the suite graphs' inputs, numpy references (float64) and PyTorch versions.

numpy only; the PyTorch blocks use tensor methods, so this module imports no torch.
"""

from __future__ import annotations

from math import erf

import numpy as np


def normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def rows_cols(d: dict) -> tuple:
    return (d["rows"], d["cols"])


def np_layernorm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean) * rstd * g + b, mean, rstd


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_erf(x):
    return np.vectorize(erf)(x)


def torch_layernorm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    rstd = ((xc * xc).mean(-1, keepdim=True) + eps).rsqrt()
    return xc * rstd * g + b, mean, rstd


def torch_softmax(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)
