"""Attention scores: scale, additive mask, softmax."""

import numpy as np

from .blocks import normal, np_softmax, torch_softmax

DESCRIPTION = "attention scores: scale, additive mask, softmax"


def relax_graph(rx, dtype, d):
    scores = rx.tensor("scores", (d["batch"], d["heads"], d["seq"], d["seq"]), dtype)
    mask = rx.tensor("mask", (d["batch"], 1, 1, d["seq"]), dtype)

    def body(bb, scores, mask):
        op = rx.op
        scaled = bb.emit(op.add(op.multiply(scores, rx.const(0.125, dtype)), mask))
        return rx.softmax(bb, scaled)

    return rx.function([scores, mask], body)


def inputs(rng, dtype, d):
    return [normal(rng, (d["batch"], d["heads"], d["seq"], d["seq"]), dtype, 4.0),
            np.where(rng.random((d["batch"], 1, 1, d["seq"])) < 0.2, -1e4, 0.0).astype(dtype)]


def numpy_reference(s, m):
    return np_softmax(s * 0.125 + m)


def torch_graph(s, m):
    return torch_softmax(s * 0.125 + m)
