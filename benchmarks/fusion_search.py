"""Greedy's grouping against the fusion search's, on CUDA sm_90 under the time model, with compile times.

Every kernel of each build (stitched and TVM's default ones) is priced by the
time model (tools/module_time.py); the compile time is the Relax pipeline's
wall time, greedy and search built in alternating order. No GPU needed.
`--cpu`: the CPU instead (this machine's llvm target): where the search's
plan differs from greedy's in some block, both builds are timed in
alternating rounds (tools/build.py: alternating_times) on the same inputs;
where it does not, the two programs are the same ("same plan").
Usage: python benchmarks/fusion_search.py [--suite] [--models bert,gpt2] [--steps forward,backward]
       [--size test] [--cpu] [OUT.md]
"""

import argparse
import sys
import time

import numpy as np
import tvm

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.target import as_target
from tvm_stitch.tools.module_time import module_time
from tables import emit

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


CPU_HEADER = ["| graph | step | kernels greedy / search | blocks searched: plan used | ms greedy | search | "
              "search / greedy |", "|---|---|---|---|---|---|---|"]


def cpu_row(name: str, step: str, mod, inputs) -> str:
    from tvm_stitch.target import host_target
    from tvm_stitch.tools.build import alternating_times, build, vm_round

    target = host_target()
    built = {f: build(mod, target, stitched=True, fusion=f) for f in ("greedy", "search")}
    searched = built["search"].report.searches
    used = sum(1 for r in searched if r.method == "search")
    kernels = [sum(1 for g in built[f].report.groups if g.stitched) for f in ("greedy", "search")]
    head = f"| {name} | {step} | {kernels[0]} / {kernels[1]} | {len(searched)}: {used} search |"
    if not used:
        return head + " same plan | same plan | 1 |"
    args = [np.asarray(a) for a in inputs]
    times = alternating_times({f: vm_round(b.executable, args) for f, b in built.items()})
    return head + f" {times['greedy']:.3f} | {times['search']:.3f} | {times['search'] / times['greedy']:.3f} |"


def fuzz_rows(n: int, seed: int) -> list:
    """The fuzzer's random graphs: the modeled comparison row of each, and its searched build checked as
    the fuzzer checks every build (llvm and emulated CUDA against TVM's default, the CUDA build, SIMT on
    pocl; nvcc every 10th graph)."""
    from tvm_stitch.tools.fuzz import build_module, check_spec, random_spec

    target = as_target({"kind": "cuda", "arch": "sm_90"})
    spec = TargetSpec.from_target(target)
    rows, failures = [], []
    for s in range(seed, seed + n):
        graph = random_spec(s)
        try:
            mod = build_module(graph)
        except Exception:  # noqa: BLE001 - the generator made an invalid graph, as the fuzzer skips it
            continue
        try:
            rows.append(row(f"fuzz {s}", "-", mod, target, spec))
        except Exception as err:  # noqa: BLE001 - reported in the table
            rows.append(f"| fuzz {s} | - | {type(err).__name__}: {str(err).splitlines()[0][:80]} |")
        outcome = check_spec(graph, cuda=True, nvcc=(s - seed) % 10 == 0, seed=s, simt=True, fusion="search")
        if not outcome.ok:
            failures.append(f"seed {s}: {outcome.message}")
        print(rows[-1], outcome.message or "checked", file=sys.stderr, flush=True)
    return rows, failures


def _issue_graphs():
    """The two graphs the greedy order cuts badly (docs/fusion-search.md), at their sizes."""
    from tvm import relax

    from tvm_stitch.tools.workloads.relax_blocks import function, tensor

    op = relax.op

    def row_and_column_sums(bb, x):
        p = bb.emit(op.multiply(op.exp(x), x))
        return relax.Tuple([bb.emit(op.sum(p, axis=[1])), bb.emit(op.sum(p, axis=[0]))])

    def centred_square_column_sum(bb, x):
        d = bb.emit(op.subtract(x, bb.emit(op.mean(x, axis=[1], keepdims=True))))
        return bb.emit(op.sum(op.multiply(d, d), axis=[0]))

    rng = np.random.default_rng(0)
    for name, body, shape in (("exp(x)*x -> row sum, column sum", row_and_column_sums, (4096, 1024)),
                              ("mean -> subtract -> square -> column sum", centred_square_column_sum, (128, 32768))):
        yield name, "-", lambda b=body, s=shape: (function([tensor("x", s, "float32")], b),
                                                  [rng.standard_normal(s).astype("float32")])


def _cases(args):
    if args.suite:
        yield from _issue_graphs()
        from tvm_stitch.tools.workloads import SUITE, dims

        for name, graph in SUITE.items():
            yield name, "-", lambda g=graph: (g.build("float32", dims(args.size)),
                                              g.inputs(np.random.default_rng(0), "float32", dims(args.size)))
    if args.models:
        from tvm_stitch.tools.model_bench import import_step

        for name in args.models.split(","):
            for step in args.steps.split(","):
                yield name, step, lambda n=name, s=step: import_step(n, s, args.size)[:2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--suite", action="store_true")
    parser.add_argument("--models", default="")
    parser.add_argument("--steps", default="forward,backward,adam")
    parser.add_argument("--size", default="test")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--fuzz", type=int, default=0, help="this many of the fuzzer's random graphs")
    args = parser.parse_args()
    target = as_target({"kind": "cuda", "arch": "sm_90"})
    spec = TargetSpec.from_target(target)
    lines = list(CPU_HEADER if args.cpu else HEADER)
    for name, step, make in _cases(args):
        try:
            mod, inputs = make()
            lines.append(cpu_row(name, step, mod, inputs) if args.cpu else row(name, step, mod, target, spec, args.rounds))
        except Exception as err:  # noqa: BLE001 - a step that does not import is reported, not fatal
            lines.append(f"| {name} | {step} | {type(err).__name__}: {str(err).splitlines()[0][:80]} |")
        print(lines[-1], file=sys.stderr, flush=True)
    if args.fuzz:
        fuzzed, failures = fuzz_rows(args.fuzz, 0)
        lines += fuzzed + [f"\nsearched builds checked: {args.fuzz} graphs, {len(failures)} failures"] + failures
    emit(lines, args.out)


if __name__ == "__main__":
    main()
