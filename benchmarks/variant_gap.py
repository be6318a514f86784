"""What a just-in-time specialisation would gain over the size variants: at each size, the modeled time of the
kernel the variants' dispatch runs there against the kernel a static build makes for exactly that size, on
sm_90 under the time model (no GPU). Each kernel is priced with its plan's register estimate. Run from the
repository root.
Usage: python benchmarks/variant_gap.py OUT.md
"""

import os
import sys

import tvm
from tvm import tirx

from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.kernels.variants import ATTR, branch_at
from tvm_stitch.pipeline import pipeline
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us
from tvm_stitch.planning.variants import SizeRange
from tvm_stitch.report import StitchReport

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import symbolic_softmax  # noqa: E402

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
N = tirx.Var("n", "int64")
CASES = {  # row length: (upper bound of n, sizes priced)
    32: (1 << 20, (1, 7, 64, 100, 512, 513, 520, 4096, 10000, 65536, 750000, 1 << 20)),
    30000: (4096, (1, 3, 8, 9, 33, 64, 65, 100, 128, 200, 256, 300, 511, 1000, 4096)),
}


def _lowered(mod):
    report = StitchReport()
    with CUDA:
        return pipeline(CUDA, report=report)(mod), report


def _kernel(lowered, attr: str) -> tirx.PrimFunc:
    return next(f for _, f in lowered.functions_items()
                if isinstance(f, tirx.PrimFunc) and f.attrs is not None and attr in f.attrs)


def _us(func: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> tuple:
    times = modeled_times(func, spec, plan.registers)
    return (total_us(times), len(times)) if times else (-1.0, 0)


def _variant_plan(dispatch: tirx.PrimFunc, report: StitchReport, size: int) -> StitchPlan:
    """The plan the dispatch runs at `size` (its ranges recorded in order, as the report lists them)."""
    (group,) = report.groups
    for (low, high, multiple, _), (_, plan) in zip(dispatch.attrs[ATTR], group.variants):
        condition = SizeRange("", None if int(low) < 0 else int(low), None if int(high) < 0 else int(high),
                              int(multiple))
        if condition.holds(size):
            return plan
    return group.plan


def rows(length: int, spec: TargetSpec) -> list:
    upper, sizes = CASES[length]
    lowered, report = _lowered(symbolic_softmax((N, length), (1, upper)))
    dispatch = _kernel(lowered, ATTR)
    out = []
    for size in sizes:
        variant = _us(branch_at(dispatch, {"n": size}), _variant_plan(dispatch, report, size), spec)
        static_lowered, static_report = _lowered(symbolic_softmax((size, length)))
        (group,) = static_report.groups
        static = _us(_kernel(static_lowered, "tvm_stitch.plan"), group.plan, spec)
        out.append(f"| ({N.name}, {length}) | {size} | {variant[1]} / {static[1]} | {variant[0]:.2f} | {static[0]:.2f} "
                   f"| {variant[0] / static[0]:.3f} |")
    return out


def main() -> None:
    spec = TargetSpec.from_target(CUDA)
    lines = ["| kernel | n | launches variants / static | modeled us, variants | static build | variants / static |",
             "|---|---|---|---|---|---|"]
    for length in CASES:
        lines += rows(length, spec)
    text = "\n".join(lines) + "\n"
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
