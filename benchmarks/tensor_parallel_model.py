"""The tensor-parallel LLaMA-style block on CUDA GPUs under the time model, per shard, at TP = 1, 2, 4, 8.

No GPU: each shard's module (tools/tensor_parallel.py, MLC-LLM's sharding) is
built up to the Relax pipeline, stitched and TVM's default, and priced by the
time model (docs/time-model.md) for the target's TargetSpec; the two
all-reduces of a shard (the attention's and the MLP's partial sums, tokens x
hidden each) are priced as ring all-reduces over the GPUs' links:
2 (p - 1) / p x bytes / bandwidth + 2 (p - 1) x latency a step.
The link's bandwidth and latency are this script's inputs (--link-gbps one
direction, --link-latency-us a step): the defaults are NVLink 4 on H200 SXM,
900 GB/s per GPU as NVIDIA publishes it (450 GB/s each direction), and an
assumed 2 us a step (NVIDIA publishes no latency figure).
Usage: python benchmarks/tensor_parallel_model.py [--arch sm_90] [--dtype float16] [OUT.md]
"""

import argparse
import sys

import tvm

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.module_time import default_module_time, stitched_module_time
from tvm_stitch.tools.tensor_parallel import BlockSize, shard_module
from tables import emit

LLAMA_7B = BlockSize(tokens=512, hidden=4096, heads=32, ffn=11008)  # one 512-token prefill
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def all_reduce_us(nbytes: int, world: int, gbps: float, latency_us: float) -> float:
    """A ring all-reduce of `nbytes` over `world` GPUs (0 for one)."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * nbytes / (gbps * 1e3) + 2 * (world - 1) * latency_us


def row(world: int, size: BlockSize, dtype: str, target, spec, link: tuple) -> str:
    module = shard_module(size, world, dtype)
    stitched, default = stitched_module_time(module, target, spec), default_module_time(module, target, spec)
    communication = 2 * all_reduce_us(size.tokens * size.hidden * DTYPE_BYTES[dtype], world, *link)
    memory = [m.us - m.compute_us() for m in (stitched, default)]
    return (f"| {world} | {default.launches} / {stitched.launches} | {memory[1]:.1f} / {memory[0]:.1f} | "
            f"{default.compute_us():.1f} / {stitched.compute_us():.1f} | {communication:.1f} | "
            f"{default.us + communication:.1f} | {stitched.us + communication:.1f} | "
            f"{(default.us + communication) / (stitched.us + communication):.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--link-gbps", type=float, default=450.0)
    parser.add_argument("--link-latency-us", type=float, default=2.0)
    args = parser.parse_args()
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    spec, size = TargetSpec.from_target(target), LLAMA_7B
    lines = [f"Modeled on {spec.describe()}; block: {size.tokens} tokens, hidden {size.hidden}, {size.heads} heads, "
             f"FFN {size.ffn}, {args.dtype}; ring all-reduce at {args.link_gbps:g} GB/s a direction, "
             f"{args.link_latency_us:g} us a step", "",
             "| TP | launches a shard default / stitched | memory-bound us default / stitched | "
             "compute-intensive us (matmuls, attention) default / stitched | 2 all-reduces us | default us | stitched us | default / stitched |",
             "|---|---|---|---|---|---|---|---|"]
    for world in (1, 2, 4, 8):
        lines.append(row(world, size, args.dtype, target, spec, (args.link_gbps, args.link_latency_us)))
        print(lines[-1], file=sys.stderr, flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
