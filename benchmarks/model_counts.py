"""CUDA launches, modeled traffic and CUDA compile time of every model step at bench size.

The CUDA half of `tvm-stitch bench --models all` (no CPU builds or timings,
which take long at bench size on a small CPU). Needs the torch extra.
Usage: python benchmarks/model_counts.py [OUT.md]
"""

import sys

from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import launches_by_kind, program_traffic
from tvm_stitch.tools.model_bench import import_step, model_steps
from tvm_stitch.tools.models import MODELS
from tables import emit


def main(out_path: str = "") -> None:
    lines = ["| model | step | memory-intensive CUDA launches | compute-intensive | modeled MB | "
             "CUDA compile s default / stitched | fallbacks |", "|---|---|---|---|---|---|---|"]
    totals = {}
    for name, step in model_steps(list(MODELS)):
        print(f"model {name} {step}", file=sys.stderr, flush=True)
        mod, _, _ = import_step(name, step, "bench")
        cuda = {}
        gpu = {"kind": "cuda", "arch": "sm_90"}
        for stitched in (False, True):
            built = build(mod, gpu, stitched=stitched)
            cuda[stitched] = (launches_by_kind(built.lowered, built.executable), program_traffic(built.lowered, gpu)[0],
                              built.compile_seconds, built.report)
        (md, cd), (ms, cs) = cuda[False][0], cuda[True][0]
        before, after = totals.get(step, (0, 0))
        totals[step] = (before + md, after + ms)
        lines.append(f"| {name} | {step} | {md} -> {ms} | {cd} -> {cs} | {cuda[False][1] / 1e6:.0f} -> "
                     f"{cuda[True][1] / 1e6:.0f} | {cuda[False][2]:.1f} / {cuda[True][2]:.1f} | "
                     f"{len(cuda[True][3].fallbacks)} |")
    lines.append("")
    for step, (before, after) in totals.items():
        lines.append(f"{step}: memory-intensive launches {before} -> {after} ({1 - after / before:.0%} fewer)")
    before = sum(b for b, _ in totals.values())
    after = sum(a for _, a in totals.values())
    lines.append(f"all steps: {before} -> {after} ({1 - after / before:.0%} fewer)")
    emit(lines, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
