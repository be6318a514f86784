"""Compile seconds of model steps: TVM's default pipeline against the stitch pipeline.

Rounds alternate the two pipelines (reversed every other round) after one
warm-up build of each, so a change of the machine's load touches both; the
table gives the median of each and their ratio. CUDA builds need no GPU.
Needs the torch extra.
Usage: python benchmarks/compile_times.py ROUNDS MODEL:STEP:SIZE:TARGET... [> OUT.md]
  TARGET: cuda (sm_90), llvm (generic x86-64) or host (`host_target()`).
"""

import statistics
import sys

from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.model_bench import import_step


def _targets() -> dict:
    return {"cuda": {"kind": "cuda", "arch": "sm_90"}, "llvm": "llvm", "host": host_target()}


def compile_seconds(mod, target, rounds: int) -> tuple:
    """(default seconds, stitched seconds): one list each, over `rounds` alternating rounds."""
    times = {False: [], True: []}
    for k in range(rounds):
        for stitched in (False, True) if k % 2 == 0 else (True, False):
            times[stitched].append(build(mod, target, stitched=stitched).compile_seconds)
    return times[False], times[True]


def main(rounds: str, *specs: str) -> None:
    targets = _targets()
    warm_up, _, _ = import_step("gpt2", "forward", "test")
    for target in targets.values():
        for stitched in (False, True):
            build(warm_up, target, stitched=stitched)
    print("| model | step | size | target | default s | stitched s | ratio | rounds default / stitched (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in specs:
        name, step, size, target = spec.split(":")
        mod, _, _ = import_step(name, step, size)
        default, stitched = compile_seconds(mod, targets[target], int(rounds))
        d, s = statistics.median(default), statistics.median(stitched)
        rounds_text = f"{', '.join(f'{x:.2f}' for x in default)} / {', '.join(f'{x:.2f}' for x in stitched)}"
        print(f"| {name} | {step} | {size} | {target} | {d:.2f} | {s:.2f} | {s / d:.2f}x | {rounds_text} |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
