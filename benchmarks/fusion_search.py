"""Greedy's grouping against the fusion search's, on CUDA sm_90 under the time model, with compile times.

Every kernel of each build (stitched and TVM's default ones) is priced by the
time model (tools/module_time.py); the compile time is the Relax pipeline's
wall time, greedy and search built in alternating order. No GPU needed.
Usage: python benchmarks/fusion_search.py [--suite] [--models bert,gpt2] [--steps forward,backward]
       [--size test] [OUT.md]
"""

import argparse
import sys
import time

import tvm

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.target import as_target
from tvm_stitch.tools.module_time import module_time

HEADER = ["| graph | step | kernels greedy / search | modeled us greedy | search | search / greedy | "
          "compile s greedy | search | blocks searched: plan used (proven) |",
          "|---|---|---|---|---|---|---|---|---|"]


def _built(mod, target, spec, fusion):
    from tvm_stitch.pipeline import pipeline

    report = StitchReport()
    start = time.perf_counter()
    with target:
        lowered = pipeline(target, fusion=fusion, report=report)(tvm.IRModule(mod.functions, attrs=mod.attrs))
    return module_time(lowered, spec), time.perf_counter() - start, report


def row(name: str, step: str, mod, target, spec, rounds: int = 1) -> str:
    times = {"greedy": [], "search": []}
    for k in range(rounds):
        for fusion in (("greedy", "search") if k % 2 == 0 else ("search", "greedy")):
            priced, seconds, report = _built(mod, target, spec, fusion)
            times[fusion].append(seconds)
            if fusion == "greedy":
                greedy = priced
            else:
                search, searched = priced, report.searches
    used = sum(1 for r in searched if r.method == "search")
    proven = sum(1 for r in searched if r.proven)
    ratio = f"{search.us / greedy.us:.3f}" if greedy.us > 0 and search.us > 0 else "-"
    return (f"| {name} | {step} | {greedy.launches} / {search.launches} | {greedy.us:.1f} | {search.us:.1f} | "
            f"{ratio} | {min(times['greedy']):.1f} | {min(times['search']):.1f} | "
            f"{len(searched)}: {used} search, {len(searched) - used} greedy ({proven} proven) |")


def _cases(args):
    if args.suite:
        from tvm_stitch.tools.workloads import SUITE, dims

        for name, graph in SUITE.items():
            yield name, "-", lambda g=graph: g.build("float32", dims(args.size))
    if args.models:
        from tvm_stitch.tools.model_bench import import_step

        for name in args.models.split(","):
            for step in args.steps.split(","):
                yield name, step, lambda n=name, s=step: import_step(n, s, args.size)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--suite", action="store_true")
    parser.add_argument("--models", default="")
    parser.add_argument("--steps", default="forward,backward,adam")
    parser.add_argument("--size", default="test")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    target = as_target({"kind": "cuda", "arch": "sm_90"})
    spec = TargetSpec.from_target(target)
    lines = list(HEADER)
    for name, step, make in _cases(args):
        try:
            lines.append(row(name, step, make(), target, spec, args.rounds))
        except Exception as err:  # noqa: BLE001 - a step that does not import is reported, not fatal
            lines.append(f"| {name} | {step} | {type(err).__name__}: {str(err).splitlines()[0][:80]} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
