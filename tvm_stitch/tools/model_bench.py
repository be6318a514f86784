"""`tvm-stitch bench --models`: real models, default vs stitched (needs the torch extra).

Per model and step (forward; backward: joint forward + backward; adam: one
Adam step over every parameter): memory-intensive and compute-intensive
CUDA launches, modeled traffic, modeled memory time (traffic at the H200's
achieved HBM bandwidth plus a gap per launch; no compute time) and CUDA
compile time of both pipelines; CPU
(llvm, this machine's CPU model) time of both builds and, for the forward
step, of PyTorch eager, measured in the same run (alternating rounds), and
the CPU compile time of both pipelines; the stitched CPU build's largest
absolute and relative difference from PyTorch float32 eager. Each model runs
in every dtype asked for (float32, float16, bfloat16: the model cast as a user
casts it, tools/models.make_model); TVM's default pipeline gets a bfloat16
model with its reductions widened to float32 (it has no bfloat16 LayerNorm).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tvm_stitch.tools.build import alternating_times, build, python_round, run_cpu, vm_round
from tvm_stitch.tools.launches import launches_by_kind, program_traffic

STEPS = ("forward", "backward", "adam")
HBM_BYTES_PER_S = 4.0e12  # H200: HBM3e's 4.8 TB/s peak, 4.0 TB/s achieved by a copy (as gpu_kit's)
LAUNCH_S = 3e-6  # device-side gap per kernel launch (as gpu_kit's)


def modeled_cuda_ms(traffic_bytes: float, launches: int) -> float:
    """Milliseconds per step on an H200 if every kernel ran at the achieved bandwidth: memory time only
    (NaN where the traffic is not modeled: program_traffic's -1)."""
    if traffic_bytes < 0:
        return float("nan")
    return 1e3 * (traffic_bytes / HBM_BYTES_PER_S + LAUNCH_S * launches)


@dataclass
class ModelRow:
    model: str
    step: str  # forward, backward or adam
    dtype: str  # the model's dtype (float32, float16, bfloat16)
    description: str
    memory_default: int  # memory-intensive CUDA launches per step
    memory_stitched: int
    compute_default: int  # compute-intensive (matmul, conv) launches
    compute_stitched: int
    mb_default: float  # modeled global-memory traffic of the CUDA build, MB per step
    mb_stitched: float
    cuda_ms_default: float  # modeled_cuda_ms of the CUDA build's traffic and launches
    cuda_ms_stitched: float
    compile_s_default: float  # CUDA pipeline + codegen
    compile_s_stitched: float
    cpu_ms_default: float  # llvm builds, median per step, measured in the same run
    cpu_ms_stitched: float
    cpu_ms_torch: float  # PyTorch eager (forward step; NaN for the others), in the same alternating rounds
    cpu_compile_s_default: float  # llvm pipeline + codegen
    cpu_compile_s_stitched: float
    max_error: float  # stitched llvm build vs PyTorch eager, max abs over outputs
    rel_error: float  # the same, relative to each output's largest magnitude (see relative_error)
    fallbacks: int


def max_abs_error(outs: list, expected: list) -> float:
    return max(float(np.max(np.abs(o.astype(np.float64) - e.astype(np.float64)))) if e.size else 0.0
               for o, e in zip(outs, expected))


def relative_error(outs: list, expected: list) -> float:
    """Max over outputs of max |out - expected| / max |expected|.

    An output whose largest magnitude is below 1e-6 of the largest over all
    outputs (a gradient that is zero up to rounding, like a key bias's under
    softmax) is measured against that overall largest magnitude instead.
    """
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0 for e in expected)
    worst = 0.0
    for o, e in zip(outs, expected):
        if e.size:
            own = float(np.max(np.abs(e)))
            err = float(np.max(np.abs(o.astype(np.float64) - e.astype(np.float64))))
            denominator = own if own >= 1e-6 * scale else scale
            worst = max(worst, err / denominator if denominator else err)
    return worst


def import_step(name: str, step: str, size: str = "bench", dtype: str = "float32"):
    """(Relax module, numpy inputs, PyTorch float32 outputs) of one step of a model cast to `dtype`."""
    from tvm_stitch.tools.models import import_model
    from tvm_stitch.tools.training import import_adam, import_backward

    if step not in STEPS:
        raise ValueError(f"step must be one of {', '.join(STEPS)}, not {step!r}")
    return {"forward": import_model, "backward": import_backward, "adam": import_adam}[step](name, size, dtype=dtype)


def torch_forward(name: str, size: str, dtype: str = "float32"):
    """A round function timing PyTorch eager's forward of a model in `dtype` (the weights import_step uses)."""
    from tvm_stitch.tools.models import _require_torch, make_model

    torch = _require_torch()
    model, inputs = make_model(name, size, dtype)

    def forward():
        with torch.no_grad():
            model(*inputs)

    return python_round(forward)


def baseline_module(mod, dtype: str):
    """The module TVM's default pipeline builds: a bfloat16 one with its reductions and transcendentals
    widened to float32 first (rewrites/precision's AccumulateInFloat32; TOPI's layer_norm refuses
    bfloat16), any other as it is."""
    from tvm_stitch.rewrites.precision import AccumulateInFloat32

    return AccumulateInFloat32()(mod) if dtype == "bfloat16" else mod


def model_steps(names: list) -> list:
    """(model, step) pairs to run: every step the model has."""
    from tvm_stitch.tools.models import MODELS

    return [(n, s) for n in names for s in STEPS if not (s == "backward" and MODELS[n].no_backward)]


def run_models(names: list, progress=None, size: str = "bench", steps=STEPS, dtypes=("float32",)) -> list:
    """Real models (torch extra): CUDA launches and traffic, default vs stitched; CPU time and correctness.

    CPU builds use this machine's CPU model (as the suite's bench does); a progress line per
    (model, step, dtype) goes to `progress` (default: the current sys.stderr).
    """
    from tvm_stitch.tools.models import MODELS
    from tvm_stitch.target import host_target

    progress = progress or sys.stderr
    cpu_target = host_target()

    pairs = [(n, s, d) for n, s in model_steps(names) if s in steps for d in dtypes]
    rows = []
    for i, (name, step, dtype) in enumerate(pairs, 1):
        print(f"[{i}/{len(pairs)}] model {name} {step} {dtype}", file=progress, flush=True)
        mod, inputs, expected = import_step(name, step, size, dtype)
        cuda = {}
        gpu = {"kind": "cuda", "arch": "sm_90"}
        baseline = baseline_module(mod, dtype)
        for stitched in (False, True):
            built = build(mod if stitched else baseline, gpu, stitched=stitched)
            cuda[stitched] = (launches_by_kind(built.lowered, built.executable),
                              program_traffic(built.lowered, gpu)[0], built.compile_seconds, built.report)
        cpu = {stitched: build(mod if stitched else baseline, cpu_target, stitched=stitched)
               for stitched in (False, True)}
        outs = run_cpu(cpu[True].executable, inputs)
        rounds = {stitched: vm_round(cpu[stitched].executable, inputs) for stitched in (False, True)}
        if step == "forward":
            rounds["torch"] = torch_forward(name, size, dtype)
        ms = alternating_times(rounds)
        rows.append(ModelRow(
            model=name, step=step, dtype=dtype,
            description=MODELS[name].description,
            memory_default=cuda[False][0][0], memory_stitched=cuda[True][0][0],
            compute_default=cuda[False][0][1], compute_stitched=cuda[True][0][1],
            mb_default=cuda[False][1] / 1e6, mb_stitched=cuda[True][1] / 1e6,
            cuda_ms_default=modeled_cuda_ms(cuda[False][1], sum(cuda[False][0])),
            cuda_ms_stitched=modeled_cuda_ms(cuda[True][1], sum(cuda[True][0])),
            compile_s_default=cuda[False][2], compile_s_stitched=cuda[True][2],
            cpu_ms_default=ms[False],
            cpu_ms_stitched=ms[True],
            cpu_ms_torch=ms.get("torch", float("nan")),
            cpu_compile_s_default=cpu[False].compile_seconds,
            cpu_compile_s_stitched=cpu[True].compile_seconds,
            max_error=max_abs_error(outs, expected),
            rel_error=relative_error(outs, expected),
            fallbacks=len(cuda[True][3].fallbacks),
        ))
    return rows


def format_models(rows: list) -> str:
    header = ("model", "step", "dtype", "memory-intensive CUDA launches (default -> stitched)",
              "compute-intensive launches", "modeled MB (default -> stitched)",
              "modeled CUDA memory ms (default -> stitched)", "CUDA compile s (default / stitched)",
              "CPU ms torch eager", "CPU ms default", "CPU ms stitched", "CPU speedup", "stitched / torch",
              "CPU compile s (default / stitched)", "max abs err vs PyTorch", "max rel err", "fallbacks")
    lines = [header]
    for r in rows:
        lines.append((r.model, r.step, r.dtype, f"{r.memory_default} -> {r.memory_stitched}",
                      f"{r.compute_default} -> {r.compute_stitched}", f"{r.mb_default:.1f} -> {r.mb_stitched:.1f}",
                      f"{r.cuda_ms_default:.3f} -> {r.cuda_ms_stitched:.3f}",
                      f"{r.compile_s_default:.1f} / {r.compile_s_stitched:.1f}",
                      f"{r.cpu_ms_torch:.2f}", f"{r.cpu_ms_default:.2f}", f"{r.cpu_ms_stitched:.2f}",
                      f"{r.cpu_ms_default / r.cpu_ms_stitched:.2f}x", f"{r.cpu_ms_stitched / r.cpu_ms_torch:.2f}x",
                      f"{r.cpu_compile_s_default:.1f} / {r.cpu_compile_s_stitched:.1f}",
                      f"{r.max_error:.1e}", f"{r.rel_error:.1e}", str(r.fallbacks)))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for step in STEPS:
        chosen = [r for r in rows if r.step == step]
        if chosen:
            md = sum(r.memory_default for r in chosen)
            ms = sum(r.memory_stitched for r in chosen)
            out.append(f"{step}: memory-intensive launches {md} -> {ms} ({100.0 * (md - ms) / max(md, 1):.0f}% "
                       f"fewer) over {len(chosen)} models")
    if rows:
        md = sum(r.memory_default for r in rows)
        ms = sum(r.memory_stitched for r in rows)
        out.insert(len(rows) + 2, "")
        out.append(f"all steps: memory-intensive launches {md} -> {ms} ({100.0 * (md - ms) / md:.0f}% fewer)")
    return "\n".join(out)
