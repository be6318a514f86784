"""The suite graphs written in PyTorch, for eager and torch.compile baselines on the GPU.

Each function takes the suite's inputs (as torch tensors, same order as
suite_data.DATA[name].inputs) and returns what the Relax graph returns.
"""

from __future__ import annotations

import torch


def _layernorm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    return xc * rstd * g + b, mean, rstd


def _softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _adam(*args):
    outs = []
    for i in range(len(args) // 4):
        p, g, m, v = args[4 * i: 4 * i + 4]
        m_new = m * 0.9 + g * 0.1
        v_new = v * 0.999 + g * g * 0.001
        outs += [p - m_new / (torch.sqrt(v_new) + 1e-8) * 1e-3, m_new, v_new]
    return tuple(outs)


def _layernorm_backward(x, dy, mean, rstd, g):
    xhat = (x - mean) * rstd
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


def _chained(x):
    centered = x - x.sum(-1, keepdim=True) / x.shape[-1]
    scaled = centered / (centered.abs().amax(-1, keepdim=True) + 1.0)
    return scaled - scaled.amin(-1, keepdim=True)


def _cross_entropy(logits, labels):
    shifted = logits - logits.amax(-1, keepdim=True)
    logp = shifted - torch.log(torch.exp(shifted).sum(-1, keepdim=True))
    return torch.nn.functional.nll_loss(logp, labels)


GRAPHS = {
    "layernorm": lambda x, g, b: _layernorm(x, g, b)[0],
    "layernorm_stats": lambda x, g, b: _layernorm(x, g, b),
    "rmsnorm": lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w,
    "softmax": _softmax,
    "attention_softmax": lambda s, m: _softmax(s * 0.125 + m),
    "bias_gelu": lambda x, b: (x + b) * 0.5 * (torch.erf((x + b) * 0.7071067811865476) + 1.0),
    "residual_layernorm": lambda x, r, g, b: (x + r, _layernorm(x + r, g, b)[0]),
    "layernorm_softmax": lambda x, g, b: _softmax(_layernorm(x, g, b)[0]),
    "cross_entropy": _cross_entropy,
    "layernorm_backward": _layernorm_backward,
    "batchnorm_stats": lambda x: (x.mean((0, 2, 3), keepdim=True),
                                  ((x - x.mean((0, 2, 3), keepdim=True)) ** 2).mean((0, 2, 3), keepdim=True)),
    "adam_update": _adam,
    "chained_reductions": _chained,
}
GRAPHS.update({
    "softmax_short_rows": GRAPHS["softmax"],
    "softmax_long_rows": GRAPHS["softmax"],
    "layernorm_backward_short_rows": _layernorm_backward,
    "batchnorm_stats_resnet": GRAPHS["batchnorm_stats"],
})
