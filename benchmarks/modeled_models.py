"""The project's models (forward, backward, Adam) at bench size on CUDA under the time model.

As benchmarks/modeled_times.py for the suite: no GPU, every kernel of TVM's
default build and of the stitched one priced by the time model. Needs the
torch extra. Usage: python benchmarks/modeled_models.py [--models bert,gpt2] [OUT.md]
"""

import argparse
import sys

import tvm

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.model_bench import import_step, model_steps
from tvm_stitch.tools.models import MODELS
from tvm_stitch.tools.module_time import default_module_time, stitched_module_time

BIG = 8 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--models", default="")
    args = parser.parse_args()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    spec = TargetSpec.from_target(target)
    lines = ["| model | step | launches default / stitched | modeled MB default / stitched | modeled us default | "
             "stitched | default / stitched | lowest threads of a kernel >= 8 MB |", "|---|---|---|---|---|---|---|---|"]
    for name, step in model_steps(args.models.split(",") if args.models else list(MODELS)):
        print(name, step, file=sys.stderr, flush=True)
        mod, _, _ = import_step(name, step, "bench")
        default, stitched = default_module_time(mod, target, spec), stitched_module_time(mod, target, spec)
        mb = [sum(c * t.bytes for _, c, ts in m.kernels for t in ts) / 1e6 for m in (default, stitched)]
        big = stitched.over(BIG)
        ratio = f"{default.us / stitched.us:.2f}x" if default.us > 0 and stitched.us > 0 else "-"
        lines.append(f"| {name} | {step} | {default.launches} / {stitched.launches} | {mb[0]:.0f} / {mb[1]:.0f} | "
                     f"{default.us:.0f} | {stitched.us:.0f} | {ratio} | "
                     f"{min(t.launched_threads for t in big) if big else '-'} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
