"""Compile seconds of a lone symbolic softmax on sm_90 with its size variants and with the plan for every
size only (the size-variant step left out), in alternating rounds in one process after one warm-up build of
each: medians of wall and CPU (process) seconds and their ratios. Run from the repository root.
Usage: python benchmarks/variant_compile_times.py ROUNDS CASE...   (CASE: n32, m30000, n768)
"""

import contextlib
import os
import statistics
import sys
import time
from unittest import mock

from tvm import tirx

from tvm_stitch import stitch_pass
from tvm_stitch.tools.build import build

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import symbolic_softmax  # noqa: E402

CUDA = {"kind": "cuda", "arch": "sm_90"}
N = tirx.Var("n", "int64")
CASES = {"n32": ((N, 32), 1 << 20), "m30000": ((N, 30000), 4096), "n768": ((N, 768), 128)}


def one_plan():
    """The stitch pass without its size-variant step: every kernel keeps the plan for every size."""
    return mock.patch.object(stitch_pass, "size_variants", lambda *_args: ())


def seconds(mod, variants: bool) -> tuple:
    """(wall, process) seconds of one build."""
    with contextlib.nullcontext() if variants else one_plan():
        wall, cpu = time.perf_counter(), time.process_time()
        build(mod, CUDA, stitched=True)
        return time.perf_counter() - wall, time.process_time() - cpu


def main(rounds: str, *cases: str) -> None:
    for name in cases:
        shape, upper = CASES[name]
        mod = symbolic_softmax(shape, (1, upper))
        seconds(mod, True), seconds(mod, False)
        times = {False: [], True: []}
        for k in range(int(rounds)):
            for variants in (False, True) if k % 2 == 0 else (True, False):
                times[variants].append(seconds(mod, variants))
        one, var = ([statistics.median(t[i] for t in times[v]) for i in (0, 1)] for v in (False, True))
        print(f"{name} wall one {one[0]:.3f} var {var[0]:.3f} ratio {var[0] / one[0]:.2f} | process one "
              f"{one[1]:.3f} var {var[1]:.3f} ratio {var[1] / one[1]:.2f} | load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
