"""The suite at bench size on CUDA under the time model: stitched (time-chosen and rule plans) vs TVM's default.

No GPU: every build stops after the Relax pipeline (kernels scheduled, not
compiled), and every kernel is priced by the time model (docs/time-model.md).
Per graph: launches, modeled MB, modeled us of TVM's default build, of the
rule plans and of the plans the time model chose, and the lowest thread
count of any stitched kernel moving 8 MB or more.
Usage: python benchmarks/modeled_times.py [--arch sm_90] [--dtype float32] [--graphs a,b] [OUT.md]
"""

import argparse
import sys
import time

import tvm

from tvm_stitch.pipeline import pipeline
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.module_time import default_module_time, module_time
from tvm_stitch.tools.workloads import SUITE, dims
from tables import emit

BIG = 8 << 20


def _stitched(mod, target, cost_model: bool):
    with target:
        lowered = pipeline(target, cost_model=cost_model)(tvm.IRModule(mod.functions, attrs=mod.attrs))
    return lowered


def row(name: str, dtype: str, target, spec) -> dict:
    mod = SUITE[name].build(dtype, dims("bench"))
    default = default_module_time(mod, target, spec)
    started = time.perf_counter()
    rules = module_time(_stitched(mod, target, False), spec)
    rules_s = time.perf_counter() - started
    started = time.perf_counter()
    chosen = module_time(_stitched(mod, target, True), spec)
    chosen_s = time.perf_counter() - started
    big = chosen.over(BIG)
    return {"graph": name, "dtype": dtype, "launches": (default.launches, rules.launches, chosen.launches),
            "mb": tuple(sum(t.bytes for _, c, ts in m.kernels for t in ts for _ in range(c)) / 1e6
                        for m in (default, rules, chosen)),
            "us": (default.us, rules.us, chosen.us),
            "min_threads_8mb": min((t.launched_threads for t in big), default=0) if big else "-",
            "seconds": (rules_s, chosen_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--graphs", default="")
    args = parser.parse_args()
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    spec = TargetSpec.from_target(target)
    lines = [f"Modeled on {spec.describe()}; time model constants: {spec.hbm_bytes_per_us / 1e6:.2f} TB/s "
             f"achievable, {spec.dram_latency_us} us DRAM latency, {spec.launch_us} us per launch",
             "", "| graph | dtype | launches default / rules / chosen | modeled MB default / stitched | "
             "modeled us default | rules | chosen | default / chosen | lowest threads of a kernel >= 8 MB | "
             "compile s rules / chosen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in (args.graphs.split(",") if args.graphs else list(SUITE)):
        print(name, file=sys.stderr, flush=True)
        r = row(name, args.dtype, target, spec)
        (dl, rl, cl), (dm, _, cm), (du, ru, cu) = r["launches"], r["mb"], r["us"]
        lines.append(f"| {name} | {args.dtype} | {dl} / {rl} / {cl} | {dm:.1f} / {cm:.1f} | {du:.1f} | {ru:.1f} | "
                     f"{cu:.1f} | {du / cu:.2f}x | {r['min_threads_8mb']} | "
                     f"{r['seconds'][0]:.1f} / {r['seconds'][1]:.1f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
