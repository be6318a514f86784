"""LayerNorm and RMSNorm backward on CUDA sm_90 under the time model: greedy partition's two kernels (a
row-resident dx, a column-split dgamma/dbeta) against the fusion search's mix-order group. No GPU:
modeled, not measured.

Per graph, shape and dtype: launches (the plans' kernels) before / after, the scheme after, its
combining blocks (0: the partials summed by a second launch), modeled MB and us (the plans'
`modeled_bytes` and `modeled_us`, docs/time-model.md) before / after, and their ratio.
Usage: python benchmarks/mix_order_table.py [--graphs layernorm_backward,rmsnorm_backward]
       [--dtypes float32,float16,bfloat16] [--shapes 4096x768,1024x4096] [OUT.md]
"""

import argparse
import sys

from tvm_stitch.tools.build import build
from tvm_stitch.tools.norm_backward_graphs import norm_backward
from tables import emit

GRAPHS = ("layernorm_backward", "rmsnorm_backward")
DTYPES = ("float32", "float16", "bfloat16")
SHAPES = ("4096x768", "1024x4096")
TARGET = {"kind": "cuda", "arch": "sm_90"}
HEADER = ("| graph | shape | dtype | launches before / after | scheme after | combining blocks | "
          "modeled MB before / after | modeled us before / after | speedup |")


def _plans(mod, fusion: str) -> list:
    return build(mod, TARGET, stitched=True, strict=True, fusion=fusion).report.plans


def row(graph: str, shape: str, dtype: str) -> str:
    rows, cols = (int(n) for n in shape.split("x"))
    mod = norm_backward(graph, dtype, rows=rows, cols=cols)[0]
    before, after = _plans(mod, "greedy"), _plans(mod, "search")
    us = [sum(p.modeled_us for p in plans) for plans in (before, after)]
    mb = [sum(p.modeled_bytes for p in plans) / 1e6 for plans in (before, after)]
    schemes = ", ".join(p.scheme for p in after)
    combining = ", ".join(str(p.mapping.combining_blocks) for p in after if p.scheme == "mix-order") or "-"
    return (f"| {graph} | {shape} | {dtype} | {sum(p.kernels for p in before)} / {sum(p.kernels for p in after)} "
            f"| {schemes} | {combining} | {mb[0]:.1f} / {mb[1]:.1f} | {us[0]:.1f} / {us[1]:.1f} "
            f"| {us[0] / us[1]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for graph in args.graphs.split(","):
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                lines.append(row(graph, shape, dtype))
                print(lines[-1], file=sys.stderr, flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
