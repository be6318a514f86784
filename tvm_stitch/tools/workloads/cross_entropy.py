"""log-softmax + NLL with a mean loss."""

import numpy as np

from .blocks import normal

DESCRIPTION = "log-softmax + NLL with a mean loss"
DTYPES = ("float32",)


def relax_graph(rx, dtype, d):
    logits, labels = rx.tensor("logits", (d["rows"], d["vocab"]), dtype), rx.tensor("labels", (d["rows"],), "int64")

    def body(bb, logits, labels):
        op = rx.op
        mx = bb.emit(op.max(logits, axis=[-1], keepdims=True))
        shifted = bb.emit(op.subtract(logits, mx))
        lse = bb.emit(op.log(op.sum(op.exp(shifted), axis=[-1], keepdims=True)))
        logp = bb.emit(op.subtract(shifted, lse))
        return bb.emit(op.nn.nll_loss(logp, labels, reduction="mean"))

    return rx.function([logits, labels], body)


def inputs(rng, dtype, d):
    return [normal(rng, (d["rows"], d["vocab"]), dtype, 2.0), rng.integers(0, d["vocab"], d["rows"]).astype("int64")]


def numpy_reference(logits, labels):
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.array(-logp[np.arange(len(labels)), labels.astype(np.int64)].mean())


def torch_graph(logits, labels):
    shifted = logits - logits.amax(-1, keepdim=True)
    logp = shifted - shifted.exp().sum(-1, keepdim=True).log()
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()
