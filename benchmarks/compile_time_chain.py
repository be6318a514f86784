"""Compile seconds of K chained LayerNorms against K: `explain` for CUDA (sm_90) and llvm, greedy and search.

Each LayerNorm of a 64 x 256 float32 input reads the one before (the shape
of issue 42's report). Per target and fusion method, K runs through 1..64,
ROUNDS times in turn (all K once, then again), after one warm-up build; the
table gives the median seconds, the kernels made and each K's time over K =
16's (linear: K = 64 at most 4x). llvm: this machine's CPU (host_target()). Times are wall seconds of the whole
`explain` (grouping, planning, pricing, scheduling; no code generation).
Usage: python benchmarks/compile_time_chain.py [ROUNDS] [K...] [> OUT.md]
"""

import os
import platform
import statistics
import sys
import time

import tvm_stitch
from tvm_stitch.target import host_target
from tvm_stitch.tools.workloads import relax_blocks as rx

LENGTHS = (1, 2, 4, 8, 16, 32, 64)


def chain(k: int, rows: int = 64, cols: int = 256):
    """K LayerNorms, each reading the one before."""
    def body(bb, x, g, b):
        for _ in range(k):
            x = rx.layernorm(bb, x, g, b, "float32")[0]
        return x
    return rx.function(rx.row_params("float32", {"rows": rows, "cols": cols}, "gamma", "beta"), body)


def timed(k: int, target, fusion: str) -> tuple:
    """(seconds, kernels) of one `explain` of a chain of k."""
    mod = chain(k)
    start = time.perf_counter()
    report = tvm_stitch.explain(mod, target, fusion=fusion)
    return time.perf_counter() - start, len(report.plans)


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main(rounds: str = "3", *lengths: str) -> None:
    ks = tuple(int(k) for k in lengths) or LENGTHS
    print(f"Machine: {_cpu()}, {os.cpu_count()} cores; "
          f"load average (1, 5, 15 min) at start {_load()}\n")
    print("| target | fusion | K | kernels | median s | rounds (s) | s / s at K = 16 |")
    print("|---|---|---|---|---|---|---|")
    configs = [(name, target, fusion) for name, target in (("cuda", {"kind": "cuda", "arch": "sm_90"}),
                                                           ("llvm", host_target()))
               for fusion in ("greedy", "search")]
    for name, target, fusion in configs:
        timed(1, target, fusion)
        times: dict = {k: [] for k in ks}
        kernels: dict = {}
        for _ in range(int(rounds)):
            for k in ks:
                seconds, kernels[k] = timed(k, target, fusion)
                times[k].append(seconds)
        base = statistics.median(times[16]) if 16 in times else None
        for k in ks:
            median = statistics.median(times[k])
            ratio = f"{median / base:.2f}" if base else "-"
            rounds_text = ", ".join(f"{x:.2f}" for x in times[k])
            print(f"| {name} | {fusion} | {k} | {kernels[k]} | {median:.2f} | {rounds_text} | {ratio} |", flush=True)
    print(f"\nLoad average at the end: {_load()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
