"""Adam step over 12 parameter tensors (independent element-wise chains)."""

import numpy as np

from .blocks import normal

DESCRIPTION = "Adam step over 12 parameter tensors (independent element-wise chains)"
DTYPES = ("float32",)
TENSORS = 12


def _shapes(d):
    return [(d["cols"] * (1 + i % 3), d["cols"] // (1 + i % 2)) for i in range(TENSORS)]


def relax_graph(rx, dtype, d):
    params = []
    for i, shape in enumerate(_shapes(d)):
        params += [rx.tensor(f"{name}{i}", shape, dtype) for name in ("p", "g", "m", "v")]

    def body(bb, *args):
        op, c = rx.op, rx.const
        outs = []
        for i in range(TENSORS):
            p, g, m, v = args[4 * i: 4 * i + 4]
            m_new = bb.emit(op.add(op.multiply(m, c(0.9, dtype)), op.multiply(g, c(0.1, dtype))))
            v_new = bb.emit(op.add(op.multiply(v, c(0.999, dtype)), op.multiply(op.multiply(g, g), c(0.001, dtype))))
            step = bb.emit(op.divide(m_new, op.add(op.sqrt(v_new), c(1e-8, dtype))))
            outs += [bb.emit(op.subtract(p, op.multiply(step, c(1e-3, dtype)))), m_new, v_new]
        return rx.Tuple(outs)

    return rx.function(params, body)


def inputs(rng, dtype, d):
    arrays = []
    for shape in _shapes(d):
        arrays += [normal(rng, shape, dtype), normal(rng, shape, dtype), normal(rng, shape, dtype),
                   np.abs(normal(rng, shape, dtype))]
    return arrays


def numpy_reference(*args):
    outs = []
    for i in range(len(args) // 4):
        p, g, m, v = args[4 * i: 4 * i + 4]
        m_new = 0.9 * m + 0.1 * g
        v_new = 0.999 * v + 0.001 * g * g
        outs += [p - 1e-3 * m_new / (np.sqrt(v_new) + 1e-8), m_new, v_new]
    return tuple(outs)


def torch_graph(*args):
    outs = []
    for i in range(len(args) // 4):
        p, g, m, v = args[4 * i: 4 * i + 4]
        m_new = m * 0.9 + g * 0.1
        v_new = v * 0.999 + g * g * 0.001
        outs += [p - m_new / (v_new.sqrt() + 1e-8) * 1e-3, m_new, v_new]
    return tuple(outs)
