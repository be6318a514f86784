"""torch.compile on the CPU: eager, the default backend (Inductor) and backend="tvm_stitch", forward and a training step.

Per model (tools/models: bert, gpt2-hf, llama-hf, convnext, at a size of
SIZES), each contender is compiled on its own copy of the model (the
first call's seconds: dynamo, the backend's build, the run), then timed
in alternating rounds (tools/build.alternating_times) in the same
process: the forward under `torch.no_grad()`, and a training step
(forward, the mean of the output's squares, backward, and
`torch.optim.AdamW(foreach=True)`'s step, compiled with the same backend
where the model is). Dropout is off, so every contender computes one
function; each compiled forward is checked against eager before timing.
A contender that fails to compile or run is reported with its error
(a NaN time), never dropped silently.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from tvm_stitch.tools.build import alternating_times, python_round

MODELS = ("bert", "gpt2-hf", "llama-hf", "convnext")
CONTENDERS = ("eager", "inductor", "tvm_stitch")
STEPS = ("forward", "train")


@dataclass
class Row:
    model: str
    step: str
    ms: dict  # contender -> median milliseconds per call
    compile_s: dict  # contender -> seconds of the first call
    errors: dict = field(default_factory=dict)  # contender -> why it has no time

    def ratio(self, contender: str) -> float:
        """How many times faster tvm_stitch is than `contender` (NaN where either has no time)."""
        return self.ms[contender] / self.ms["tvm_stitch"]


def model_output(result):
    """The tensor a model's call returns (a transformers output's last hidden state)."""
    import torch

    if isinstance(result, torch.Tensor):
        return result
    return result.last_hidden_state if hasattr(result, "last_hidden_state") else result[0]


def prepared_model(name: str, size: str, train: bool):
    """tools/models.py's model `name` at `size` and its inputs, dropout off, in training mode when `train`
    (transformers' KV cache off then)."""
    import torch

    from tvm_stitch.tools.models import make_model

    model, inputs = make_model(name, size)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None) or getattr(getattr(model, "bert", None), "config", None)
    if config is not None and train:
        config.use_cache = False
    return model.train(train), inputs


def _backend(contender: str):
    """Inductor by name; ours as the callable the `tvm_stitch` entry point names (no reinstall needed)."""
    from tvm_stitch.torch import compile_graph

    return "inductor" if contender == "inductor" else compile_graph


def _compiled(model, contender: str, dynamic):
    import torch

    return model if contender == "eager" else torch.compile(model, backend=_backend(contender), dynamic=dynamic)


def _forward_call(model, contender, inputs):
    import torch

    fn = _compiled(model, contender, None)

    def call():
        with torch.no_grad():
            return model_output(fn(*inputs))

    return call


def _train_call(model, contender, inputs):
    import torch

    fn = _compiled(model, contender, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = optimizer.step if contender == "eager" else torch.compile(optimizer.step, backend=_backend(contender))

    def call():
        loss = model_output(fn(*inputs)).pow(2).mean()
        loss.backward()
        step()
        optimizer.zero_grad()
        return loss

    return call


def bench_model(name: str, step: str, size: str = "test", rounds: int = 5, round_ms: float = 200.0) -> Row:
    """One model and step: every contender's compile seconds and median ms per call, alternating rounds."""
    import torch

    base, inputs = prepared_model(name, size, train=step == "train")
    make = _forward_call if step == "forward" else _train_call
    calls, compile_s, errors = {}, {}, {}
    expected = model_output(base(*inputs)).detach() if step == "forward" else None
    for contender in CONTENDERS:
        model = copy.deepcopy(base)
        call = make(model, contender, inputs)
        start = time.perf_counter()
        try:
            got = call()
        except Exception as err:  # noqa: BLE001 - a backend failing on a model is a result
            errors[contender] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
            continue
        compile_s[contender] = time.perf_counter() - start
        if expected is not None and not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
            errors[contender] = f"output differs from eager by {(got - expected).abs().max().item():.3g}"
            continue
        calls[contender] = python_round(call, round_ms)
    ms = alternating_times(calls, rounds)
    return Row(name, step, {c: ms.get(c, float("nan")) for c in CONTENDERS},
               {c: compile_s.get(c, float("nan")) for c in CONTENDERS}, errors)


def run(models=MODELS, steps=STEPS, size: str = "test", rounds: int = 5, round_ms: float = 200.0,
        progress=None) -> list:
    rows = []
    for name in models:
        for step in steps:
            rows.append(bench_model(name, step, size, rounds, round_ms))
            if progress is not None:
                progress(format_rows(rows[-1:]))
    return rows


def format_rows(rows: list) -> str:
    """A markdown table: ms per call, tvm_stitch's speed-up over each, compile seconds."""
    lines = ["| model | step | eager ms | inductor ms | tvm_stitch ms | vs eager | vs inductor | "
             "compile s (inductor / tvm_stitch) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.step} | {r.ms['eager']:.2f} | {r.ms['inductor']:.2f} | "
                     f"{r.ms['tvm_stitch']:.2f} | {r.ratio('eager'):.2f}x | {r.ratio('inductor'):.2f}x | "
                     f"{r.compile_s['inductor']:.1f} / {r.compile_s['tvm_stitch']:.1f} |")
    for r in rows:
        for contender, why in r.errors.items():
            lines.append(f"\n{r.model} {r.step}, {contender}: {why}")
    return "\n".join(lines)
