"""BERT, GPT-2 and LLaMA in bfloat16 and float16 on CUDA sm_90 under the time model: forward, backward and
Adam steps, TVM's default build beside the stitched one, every kernel (GEMMs included) priced by the same
model (tools/mixed_precision.py). No GPU: modeled, not measured.

Per step: launches, modeled us of both builds and their ratio, the GEMMs' part of each total, how many
GEMMs are priced on tensor cores, and each build's bound mix (launches per bound: compute, memory,
latency, launch; sfu and serial where any). Needs the torch extra.
Usage: python benchmarks/mixed_precision_table.py [--models bert,gpt2,llama] [--dtypes bfloat16,float16]
       [--steps forward,backward,adam] [--size bench] [OUT.md]
"""

import argparse
import sys

from tvm_stitch.tools.mixed_precision import BOUNDS, bound_mix, price_step, tensor_core_gemms
from tvm_stitch.tools.model_bench import model_steps
from tables import emit

MODELS = ("bert", "gpt2", "llama")
DTYPES = ("bfloat16", "float16")
TARGET = {"kind": "cuda", "arch": "sm_90"}
HEADER = ("| model | dtype | step | launches default / stitched | modeled us default | stitched | default / stitched "
          "| GEMM us default / stitched | GEMMs on tensor cores default / stitched | bounds default | bounds stitched |")


def _mix(priced) -> str:
    mix = bound_mix(priced)
    return ", ".join(f"{bound} {mix[bound]}" for bound in BOUNDS if mix[bound])


def _tensor_cores(priced) -> str:
    gemms, on_tc = tensor_core_gemms(priced)
    return f"{len(on_tc)} of {len(gemms)}"


def _row(p) -> str:
    ratio = f"{p.ratio():.2f}x" if p.ratio() else "-"
    return (f"| {p.model} | {p.dtype} | {p.step} | {p.default.launches} / {p.stitched.launches} | {p.default.us:.0f} "
            f"| {p.stitched.us:.0f} | {ratio} | {p.default.compute_us():.0f} / {p.stitched.compute_us():.0f} "
            f"| {_tensor_cores(p.default)} / {_tensor_cores(p.stitched)} | {_mix(p.default)} | {_mix(p.stitched)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--steps", default="", help="comma-separated steps (default: every step a model has)")
    parser.add_argument("--size", default="bench")
    args = parser.parse_args()
    steps = args.steps.split(",") if args.steps else None
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for model, step in model_steps(args.models.split(",")):
        if steps is not None and step not in steps:
            continue
        for dtype in args.dtypes.split(","):
            print(model, dtype, step, file=sys.stderr, flush=True)
            lines.append(_row(price_step(model, step, dtype, TARGET, args.size)))
            print(lines[-1], file=sys.stderr, flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
