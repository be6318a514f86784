"""CPU size variants of a lone symbolic (n, LENGTH) float32 softmax on this machine's CPU (llvm, host target):
compile seconds with the size-variant step and without it (the plan for every size only), in alternating rounds
in one process after one warm-up build of each (medians of wall and CPU seconds, and their ratios); then, at each
row count asked for, milliseconds per call of both builds and of the static build at that count, in alternating
rounds (tools/build.alternating_times), and their ratios to the one-plan build. The cores planned for are the
runtime's threads: run with TVM_NUM_THREADS set to the cores. Run from the repository root.
Usage: TVM_NUM_THREADS=2 python benchmarks/cpu_variant_times.py LENGTH COMPILE_ROUNDS TIMING_ROUNDS ROWS...
"""

import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import numpy as np
from tvm import tirx

from tvm_stitch.stitch import kernel_maker
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import alternating_times, build, vm_round

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import symbolic_softmax  # noqa: E402

N = tirx.Var("n", "int64")


def softmax(length: int, rows=N):
    return symbolic_softmax((rows, length))


def one_plan():
    """The stitch pass without its CPU size-variant step: every kernel keeps the plan for every size."""
    return mock.patch.object(kernel_maker, "cpu_size_variants", lambda *_args: ())


def built(mod, variants: bool):
    """(the build, its wall seconds, its process seconds)."""
    with contextlib.nullcontext() if variants else one_plan():
        wall, cpu = time.perf_counter(), time.process_time()
        out = build(mod, host_target(), stitched=True)
        return out, time.perf_counter() - wall, time.process_time() - cpu


def main(length: str, compile_rounds: str, timing_rounds: str, *rows: str) -> None:
    mod = softmax(int(length))
    made = {v: built(mod, v)[0] for v in (True, False)}
    variants = made[True].report.groups[0].variants
    print(f"(n, {length}), threads {os.environ.get('TVM_NUM_THREADS', '?')}; variants: "
          + ("; ".join(f"{c}: {p.mapping.split} chunks/row" for c, p in variants) or "none"))
    rng = np.random.default_rng(0)
    for count in map(int, rows):
        x = rng.standard_normal((count, int(length))).astype("float32")
        static = build(softmax(int(length), count), host_target(), stitched=True)
        ms = alternating_times({"variants": vm_round(made[True].executable, [x]),
                                "one": vm_round(made[False].executable, [x]),
                                "static": vm_round(static.executable, [x])}, int(timing_rounds))
        print(f"run at n = {count}: variants {ms['variants']:.3f} ms, one plan {ms['one']:.3f} ms, static build "
              f"{ms['static']:.3f} ms ({static.report.groups[0].plan.mapping.split} chunks/row); ratios to the "
              f"one plan: variants {ms['variants'] / ms['one']:.2f}, static {ms['static'] / ms['one']:.2f} | "
              f"load {os.getloadavg()[0]:.1f}", flush=True)

    times = {False: [], True: []}
    for k in range(int(compile_rounds)):
        for v in (False, True) if k % 2 == 0 else (True, False):
            times[v].append(built(mod, v)[1:])
    one, var = ([statistics.median(t[i] for t in times[v]) for i in (0, 1)] for v in (False, True))
    print(f"compile: wall one {one[0]:.3f} var {var[0]:.3f} ratio {var[0] / one[0]:.2f} | process one "
          f"{one[1]:.3f} var {var[1]:.3f} ratio {var[1] / one[1]:.2f} | load {os.getloadavg()[0]:.1f}", flush=True)

if __name__ == "__main__":
    main(*sys.argv[1:])
