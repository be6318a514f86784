"""Building a Relax module with the default or the stitch pipeline, and running it on the CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .kernels import count_launches
from .pipeline import pipeline
from .report import StitchReport
from .target import as_target, default_pipeline


@dataclass
class Built:
    executable: object
    lowered: tvm.IRModule
    report: StitchReport | None
    compile_seconds: float


def build(mod: tvm.IRModule, target, stitched: bool, strict: bool = False,
          emulate: str | None = None, cost_model: bool = True) -> Built:
    """Compile `mod` with the stitch pipeline (stitched=True) or TVM's default one.

    `emulate="cuda"` (llvm only): the CUDA schedules, without thread bindings.
    `cost_model=False`: kernel configurations from the rules alone.
    """
    target = as_target(target)
    report = StitchReport() if stitched else None
    pipe = (pipeline(target, strict=strict, report=report, emulate=emulate, cost_model=cost_model) if stitched
            else default_pipeline(target))
    start = time.perf_counter()
    with target:
        lowered = pipe(tvm.IRModule(mod.functions, attrs=mod.attrs))
    executable = tvm.compile(lowered, target=target, relax_pipeline=None)
    return Built(executable, lowered, report, time.perf_counter() - start)


def cuda_launches(mod: tvm.IRModule, stitched: bool, arch: str = "sm_90") -> int:
    """CUDA kernel launches per call of `main` (no GPU needed: counts the built module)."""
    built = build(mod, {"kind": "cuda", "arch": arch}, stitched)
    return count_launches(built.lowered, built.executable)


def _flatten(result) -> list:
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [a for r in result for a in _flatten(r)]
    return [result.numpy()]


def run_cpu(executable, inputs: list) -> list:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return _flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))


def time_cpu(executable, inputs: list, min_ms: int = 200) -> float:
    """Median milliseconds per call of `main` on the CPU."""
    dev = tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    vm["main"](*args)
    timer = vm.time_evaluator("main", dev, number=1, repeat=5, min_repeat_ms=min_ms)
    return float(np.median(timer(*args).results) * 1e3)
