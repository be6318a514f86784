"""Training graphs of the real models: the backward pass and an Adam step.

Backward: `torch.export` cannot trace `torch.autograd.grad` or `torch.func.vjp`
on torch 2.13 (a fake tensor lands in the constants; functorch views cannot
be converted), so the joint forward + backward graph is traced with
`make_fx` over `torch.func.vjp`, with PyTorch's core ATen decompositions
(its backward ops become element-wise ops and reductions), then exported
and imported like a forward. What `vjp` differentiates is the model's
forward exported by torch.export first (a transformers model under
from_torch's export settings: no KV cache, eager attention): the export
resolves the model's Python, such as transformers' check for packed
sequences, a data-dependent branch that make_fx cannot trace. An
embedding's gradient (`index_put` accumulating over the token ids) is
imported by the converter the torch.compile backend uses. Inputs: the model's inputs, the cotangent of
its output, its parameters; outputs: the model's output and the gradient of
every trained parameter.

The native_layer_norm trap: TVM 0.27's importer maps all three outputs of
`aten.native_layer_norm` (normalised output, mean, rstd) to the normalised
output, so a backward that reads mean or rstd is silently wrong. LayerNorm
is therefore decomposed into mean, subtract, rsqrt before tracing, and
`check_layer_norm_stats` refuses any graph that still reads those outputs.

Adam: one step of `torch.optim.Adam` over every parameter tensor, written
as tensor code (inputs: parameters, gradients, first and second moments;
outputs: the new parameters and moments), checked against torch.optim.Adam.
"""

from __future__ import annotations

import warnings

from tvm_stitch.frontend import export_settings, from_torch
from tvm_stitch.tools.models import MODELS, _require_torch, as_numpy, cast_floats, make_model

ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "step": 3}


class LayerNormTrapError(RuntimeError):
    """A graph reads the mean or rstd output of native_layer_norm (TVM's importer gets them wrong)."""


def _layer_norm(x, normalized_shape, weight, bias, eps):
    """native_layer_norm as mean, subtract, rsqrt: (output, mean, rstd) all real tensors."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    rstd = (centred * centred).mean(dims, keepdim=True).add(eps).rsqrt()
    out = centred * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


def decompositions() -> dict:
    """PyTorch's core ATen decompositions, with LayerNorm decomposed too."""
    torch = _require_torch()
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table[torch.ops.aten.native_layer_norm.default] = _layer_norm
    return table


def check_layer_norm_stats(graph) -> None:
    """Raise LayerNormTrapError if a node reads output 1 (mean) or 2 (rstd) of native_layer_norm."""
    import operator

    torch = _require_torch()
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.native_layer_norm.default:
            for user in node.users:
                if user.target is operator.getitem and user.args[1] in (1, 2) and user.users:
                    raise LayerNormTrapError(
                        f"{user.name} reads {'mean' if user.args[1] == 1 else 'rstd'} of native_layer_norm "
                        f"{node.name}; TVM's importer maps it to the normalised output (wrong gradients). "
                        "Decompose LayerNorm before tracing (tvm_stitch.tools.training.decompositions()).")


def _import_callable(fn, args):
    """Export a callable of tensors (no autograd inside) and import it into Relax."""
    torch = _require_torch()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fn = fn  # a traced GraphModule registers as a submodule, with its constants

        def forward(self, *tensors):
            return self.fn(*tensors)

    return from_torch(Wrapped(), tuple(args))


def hidden(output):
    """The tensor a model returns, or the first of a transformers output (its last hidden state)."""
    return output.to_tuple()[0] if hasattr(output, "to_tuple") else output


def trained_parameters(model, inputs) -> list:
    """(name, parameter) pairs the backward differentiates: those the output depends on.

    Runs one eager forward and backward to find them (a pooler the output
    does not use gets no gradient).
    """
    torch = _require_torch()
    model.zero_grad()
    with torch.enable_grad():
        hidden(model(*inputs)).sum().backward()
    used = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return used


def import_backward(name: str, size: str = "bench", dtype: str = "float32"):
    """(Relax module, numpy inputs, PyTorch eager outputs) of a model's joint forward + backward.

    Inputs: model inputs, a random cotangent of the output, trained
    parameters; outputs: the model output, then one gradient per trained
    parameter. The expected values come from eager `backward()` in float32
    (of the model cast to `dtype`, its weights and inputs then in float32).
    """
    if MODELS[name].no_backward:
        raise NotImplementedError(f"{name}: no backward graph: {MODELS[name].no_backward}")
    model, inputs = make_model(name, size, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # from_torch's notes on the export settings of transformers models
        with export_settings(model):  # a transformers model without its KV cache, with eager attention
            traced, args, expected = _trace_backward(model, inputs)
    return _import_callable(traced, args), [as_numpy(a) for a in args], [as_numpy(e) for e in expected]


def _trace_backward(model, inputs):
    """(joint forward + backward traced by make_fx, its arguments, float32 eager's output and gradients)."""
    torch = _require_torch()
    from torch.fx.experimental.proxy_tensor import make_fx

    trained = trained_parameters(model, inputs)
    names = [n for n, _ in trained]
    params = tuple(p.detach().clone() for _, p in trained)
    with torch.no_grad():
        cotangent = torch.randn_like(hidden(model(*inputs)))
    n_in = len(inputs)
    with torch.no_grad():
        exported = torch.export.export(model, inputs).module()

    def joint(*tensors):
        model_inputs, cot, weights = tensors[:n_in], tensors[n_in], tensors[n_in + 1:]

        def forward(ws):
            return hidden(torch.func.functional_call(exported, dict(zip(names, ws)), model_inputs, strict=False))

        out, vjp = torch.func.vjp(forward, weights)
        return (out, *vjp(cot)[0])

    args = (*inputs, cotangent, *params)
    traced = make_fx(joint, decomposition_table=decompositions())(*args)
    check_layer_norm_stats(traced.graph)

    model.float()
    out = hidden(model(*cast_floats(inputs, "float32")))
    out.backward(cotangent.float())
    return traced, args, [out.detach()] + [p.grad for _, p in trained]


def _adam(lr, beta1, beta2, eps, step):
    """Adam's update of lists of tensors, as torch.optim.Adam computes it (no weight decay, no amsgrad)."""
    correction1 = 1 - beta1 ** step
    correction2_sqrt = (1 - beta2 ** step) ** 0.5

    def update(*tensors):
        n = len(tensors) // 4
        params, grads, m, v = (tensors[i * n:(i + 1) * n] for i in range(4))
        new_m = [beta1 * mi + (1 - beta1) * g for mi, g in zip(m, grads)]
        new_v = [beta2 * vi + (1 - beta2) * g * g for vi, g in zip(v, grads)]
        new_p = [p - (lr / correction1) * mi / (vi.sqrt() / correction2_sqrt + eps)
                 for p, mi, vi in zip(params, new_m, new_v)]
        return (*new_p, *new_m, *new_v)

    return update


def import_adam(name: str, size: str = "bench", dtype: str = "float32"):
    """(Relax module, numpy inputs, torch.optim.Adam's results) of one Adam step over the model's parameters.

    Inputs: parameters, gradients, first moments, second moments (random,
    seeded, all in `dtype`); outputs: new parameters, first moments, second
    moments. The expected values are torch.optim.Adam's in float32 on the same values.
    """
    torch = _require_torch()

    model, _ = make_model(name, size)
    params = [p.detach().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) for p in params]
    m = [0.1 * torch.randn_like(p) for p in params]
    v = [0.01 * torch.rand_like(p) for p in params]
    beta1, beta2 = ADAM["betas"]
    args = cast_floats((*params, *grads, *m, *v), dtype)
    mod = _import_callable(_adam(ADAM["lr"], beta1, beta2, ADAM["eps"], ADAM["step"]), args)
    n = len(params)
    params, grads, m, v = (list(cast_floats(args[i * n:(i + 1) * n], "float32")) for i in range(4))

    weights = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.Adam(weights, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"], foreach=False)
    for w, g, mi, vi in zip(weights, grads, m, v):
        w.grad = g.clone()
        optimizer.state[w] = {"step": torch.tensor(float(ADAM["step"] - 1)), "exp_avg": mi.clone(),
                              "exp_avg_sq": vi.clone()}
    optimizer.step()
    expected = ([w.detach() for w in weights] + [optimizer.state[w]["exp_avg"] for w in weights]
                + [optimizer.state[w]["exp_avg_sq"] for w in weights])
    return mod, [as_numpy(a) for a in args], [as_numpy(e) for e in expected]
