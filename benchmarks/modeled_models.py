"""The project's models (forward, backward, Adam) at bench size on CUDA under the time model.

As benchmarks/modeled_times.py for the suite: no GPU, every kernel of TVM's
default build and of the stitched one priced by the time model. Per step:
launches, modeled MB, modeled us of both builds and their ratio, the part of
each total in compute-intensive kernels (matmuls, convolutions: dlight's in
both builds), and the lowest thread count of a stitched kernel moving 8 MB
or more. Needs the torch extra.
Usage: python benchmarks/modeled_models.py [--models bert,gpt2] [--steps backward] [--json DIR] [OUT.md]
"""

import argparse
import dataclasses
import json
import os
import sys

import tvm

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.model_bench import import_step, model_steps
from tvm_stitch.tools.models import MODELS
from tvm_stitch.tools.module_time import default_module_time, stitched_module_time
from tables import emit

BIG = 8 << 20
HEADER = ("| model | step | launches default / stitched | modeled MB default / stitched | modeled us default | stitched "
          "| default / stitched | matmul+conv us default / stitched | other us default / stitched "
          "| lowest threads of a stitched kernel >= 8 MB |")


def _megabytes(priced) -> float:
    return sum(calls * t.bytes for _, calls, times in priced.kernels for t in times) / 1e6


def _row(name: str, step: str, default, stitched) -> str:
    ratio = f"{default.us / stitched.us:.2f}x" if default.us > 0 and stitched.us > 0 else "-"
    big = stitched.over(BIG, stitched_only=True)
    compute = [m.compute_us() for m in (default, stitched)]
    other = [m.us - c if m.us > 0 else -1 for m, c in zip((default, stitched), compute)]
    return (f"| {name} | {step} | {default.launches} / {stitched.launches} | {_megabytes(default):.0f} / "
            f"{_megabytes(stitched):.0f} | {default.us:.0f} | {stitched.us:.0f} | {ratio} | {compute[0]:.0f} / "
            f"{compute[1]:.0f} | {other[0]:.0f} / {other[1]:.0f} | "
            f"{min(t.launched_threads for t in big) if big else '-'} |")


def _records(priced) -> dict:
    """Per PrimFunc: calls, stitched or not, compute or not, and each kernel's KernelTime (no geometry)."""
    return {"us": priced.us, "launches": priced.launches, "unpriced": list(priced.unpriced), "kernels": [
        {"name": name, "calls": calls, "stitched": name in priced.stitched, "compute": name in priced.compute,
         "times": [{k: v for k, v in dataclasses.asdict(t).items() if k != "geometry"} for t in times]}
        for name, calls, times in priced.kernels]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--models", default="")
    parser.add_argument("--steps", default="", help="comma-separated steps (default: every step a model has)")
    parser.add_argument("--json", default="", help="a folder for one JSON file of per-kernel times per step")
    args = parser.parse_args()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    spec = TargetSpec.from_target(target)
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    steps = args.steps.split(",") if args.steps else None
    for name, step in model_steps(args.models.split(",") if args.models else list(MODELS)):
        if steps is not None and step not in steps:
            continue
        print(name, step, file=sys.stderr, flush=True)
        mod, _, _ = import_step(name, step, "bench")
        default, stitched = default_module_time(mod, target, spec), stitched_module_time(mod, target, spec)
        lines.append(_row(name, step, default, stitched))
        print(lines[-1], file=sys.stderr, flush=True)
        if args.json:
            os.makedirs(args.json, exist_ok=True)
            with open(os.path.join(args.json, f"{name}-{step}.json"), "w", encoding="utf-8") as f:
                json.dump({"default": _records(default), "stitched": _records(stitched)}, f, indent=1)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
