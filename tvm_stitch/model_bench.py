"""`tvm-stitch bench --models`: real models, default vs stitched (needs the torch extra).

Per model: memory-intensive and compute-intensive CUDA launches, modeled
traffic and CUDA compile time of both pipelines; the stitched CPU build's
largest difference from PyTorch eager.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .bench import _max_error
from .build import build, run_cpu
from .traffic import program_traffic


@dataclass
class ModelRow:
    model: str
    description: str
    memory_default: int  # memory-intensive CUDA launches per forward
    memory_stitched: int
    compute_default: int  # compute-intensive (matmul, conv) launches
    compute_stitched: int
    mb_default: float
    mb_stitched: float
    compile_s_default: float  # CUDA pipeline + codegen
    compile_s_stitched: float
    max_error: float  # stitched llvm build vs PyTorch eager
    fallbacks: int


def run_models(names: list, progress=sys.stderr) -> list:
    """Real models (torch extra): CUDA launches and traffic, default vs stitched; correctness on the CPU."""
    from .kernels import launches_by_kind
    from .models import MODELS, import_model

    rows = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] model {name}", file=progress, flush=True)
        mod, inputs, expected = import_model(name)
        cuda = {}
        for stitched in (False, True):
            built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=stitched)
            cuda[stitched] = (launches_by_kind(built.lowered, built.executable),
                              program_traffic(built.lowered)[0], built.compile_seconds, built.report)
        cpu = build(mod, {"kind": "llvm"}, stitched=True)
        outs = run_cpu(cpu.executable, inputs)
        rows.append(ModelRow(
            model=name,
            description=MODELS[name].description,
            memory_default=cuda[False][0][0], memory_stitched=cuda[True][0][0],
            compute_default=cuda[False][0][1], compute_stitched=cuda[True][0][1],
            mb_default=cuda[False][1] / 1e6, mb_stitched=cuda[True][1] / 1e6,
            compile_s_default=cuda[False][2], compile_s_stitched=cuda[True][2],
            max_error=_max_error(outs, [e.astype(np.float64) for e in expected]),
            fallbacks=len(cuda[True][3].fallbacks),
        ))
    return rows


def format_models(rows: list) -> str:
    header = ("model", "memory-intensive CUDA launches (default -> stitched)", "compute-intensive launches",
              "modeled MB (default -> stitched)", "CUDA compile s (default / stitched)",
              "max abs err vs PyTorch", "fallbacks")
    lines = [header]
    for r in rows:
        lines.append((r.model, f"{r.memory_default} -> {r.memory_stitched}",
                      f"{r.compute_default} -> {r.compute_stitched}", f"{r.mb_default:.1f} -> {r.mb_stitched:.1f}",
                      f"{r.compile_s_default:.1f} / {r.compile_s_stitched:.1f}", f"{r.max_error:.1e}",
                      str(r.fallbacks)))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if rows:
        md = sum(r.memory_default for r in rows)
        ms = sum(r.memory_stitched for r in rows)
        out.append("")
        out.append(f"memory-intensive launches {md} -> {ms} ({100.0 * (md - ms) / md:.0f}% fewer) over "
                   f"{len(rows)} models")
    return "\n".join(out)
