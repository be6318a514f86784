"""The GEMM kernels of the stitched builds of BERT, GPT-2 and LLaMA in bfloat16 and float16 as nvcc compiles
them: per model, dtype, step and arch, how many GEMM kernels there are, how many carry tensor-core mma
instructions in their PTX (mma.sync or wmma.mma) and how many spill (ptxas -v), with the rule of each
kernel that does not carry mma or spills (tools/gemm_ptx.py). The fused attention kernels (rule
"attention") are counted beside the GEMMs. Needs nvcc and the torch extra; no GPU.

Usage: python benchmarks/gemm_ptx.py [--models bert,gpt2,llama] [--dtypes bfloat16,float16]
       [--steps forward,backward] [--archs sm_80,sm_90] [--size bench] [OUT.md]
"""

import argparse
import sys

from tvm_stitch.tools.build import build
from tvm_stitch.tools.gemm_ptx import gemm_kernels
from tvm_stitch.tools.model_bench import import_step, model_steps
from tables import emit

HEADER = ("| model | dtype | step | arch | GEMM kernels | with mma | spilling | registers (max) | rules "
          "| kernels without mma or spilling |")


def _row(model: str, dtype: str, step: str, arch: str, size: str) -> str:
    mod, _, _ = import_step(model, step, size, dtype)
    kernels = gemm_kernels(build(mod, {"kind": "cuda", "arch": arch}, stitched=True), arch)
    rules = {}
    for k in kernels:
        rules[k.rule] = rules.get(k.rule, 0) + 1
    bad = [f"{k.kernel} ({k.rule}, {k.mma} mma, {k.registers} registers, {k.spill_bytes} spill bytes)"
           for k in kernels if not k.mma or k.spill_bytes]
    with_mma = sum(1 for k in kernels if k.mma)
    spilling = sum(1 for k in kernels if k.spill_bytes)
    most = max((k.registers for k in kernels), default=0)
    return (f"| {model} | {dtype} | {step} | {arch} | {len(kernels)} | {with_mma} | {spilling} | {most} "
            f"| {', '.join(f'{r} {n}' for r, n in sorted(rules.items()))} | {'; '.join(bad) or '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--models", default="bert,gpt2,llama")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--steps", default="forward,backward")
    parser.add_argument("--archs", default="sm_80,sm_90")
    parser.add_argument("--size", default="bench")
    args = parser.parse_args()
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for model, step in model_steps(args.models.split(",")):
        if step not in args.steps.split(","):
            continue
        for dtype in args.dtypes.split(","):
            for arch in args.archs.split(","):
                print(model, dtype, step, arch, file=sys.stderr, flush=True)
                lines.append(_row(model, dtype, step, arch, args.size))
                print(lines[-1], file=sys.stderr, flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
