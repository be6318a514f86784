"""Stitched kernels per graph on CUDA sm_90 under the time model: how much of the peak bandwidth each
graph's kernels reach, and the reason code of every kernel the idle guard flags (pricing/idle_guard.py).

The suite at bench size (first dtype of each graph) and the graphs of tools/idle_graphs.py, planned by
`explain` (no build, no GPU). Per graph: stitched kernels, their launches, their modeled microseconds and megabytes,
the share of the peak bandwidth of the whole and of its slowest kernel of 4 MB or more, and the idle
kernels' codes.
Usage: python benchmarks/idle_kernels.py [OUT.md]
"""

import sys

import tvm

import tvm_stitch
from tvm_stitch.planning.time_model import peak_bytes_per_us
from tvm_stitch.pricing.idle_guard import IDLE_BYTES, bandwidth_share, is_idle
from tvm_stitch.tools.idle_graphs import GRAPHS
from tvm_stitch.tools.workloads import SUITE, dims
from tables import emit

HEADER = ["| graph | kernels | launches | modeled us | modeled MB | of peak BW | lowest of a kernel >= 4 MB | idle kernels: reason |",
          "|---|---|---|---|---|---|---|---|"]


def row(name: str, mod, target) -> str:
    plans = tvm_stitch.explain(mod, target).plans
    us = sum(p.modeled_us for p in plans)
    nbytes = sum(p.modeled_bytes for p in plans)
    share = nbytes / us / peak_bytes_per_us(plans[0].spec) if us > 0 else -1.0
    big = [bandwidth_share(p) for p in plans if p.modeled_bytes >= IDLE_BYTES]
    idle = "; ".join(f"{p.kernel} {bandwidth_share(p):.0%}: {p.idle.code if p.idle else 'UNEXPLAINED'}"
                     for p in plans if is_idle(p)) or "-"
    lowest = f"{min(big):.0%}" if big else "-"
    return f"| {name} | {len(plans)} | {sum(p.kernels for p in plans)} | {us:.1f} | {nbytes / 1e6:.1f} | {share:.0%} | {lowest} | {idle} |"


def main(out_path: str | None) -> None:
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    lines = list(HEADER)
    for name in sorted(SUITE):
        graph = SUITE[name]
        lines.append(row(f"{name} ({graph.dtypes[0]})", graph.build(graph.dtypes[0], dims("bench")), target))
    for name, make in GRAPHS.items():
        lines.append(row(name, make(), target))
    emit(lines, out_path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
