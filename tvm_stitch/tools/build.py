"""Building a Relax module with the default or the stitch pipeline, and running and timing it on the CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from tvm_stitch.tools.launches import count_launches
from tvm_stitch.pipeline import pipeline
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch import DEFAULT_FUSION
from tvm_stitch.target import as_target, default_pipeline


@dataclass
class Built:
    executable: object
    lowered: tvm.IRModule
    report: StitchReport | None
    compile_seconds: float


def build(mod: tvm.IRModule, target, stitched: bool, strict: bool = False,
          emulate=None, cost_model=True, spec=None, fast_math=None, fusion: str = DEFAULT_FUSION,
          allow_tf32: bool = False) -> Built:
    """Compile `mod` with the stitch pipeline (stitched=True) or TVM's default one.

    `emulate="cuda"` (llvm only): the CUDA schedules, without thread bindings.
    `cost_model=False`: kernel configurations from the rules alone.
    `spec`: plan for this TargetSpec instead of the target's own.
    `fast_math`: as `pipeline`'s (None: on for llvm, off for CUDA). `fusion`, `allow_tf32`: as `pipeline`'s.
    """
    target = as_target(target)
    report = StitchReport() if stitched else None
    pipe = (pipeline(target, strict=strict, report=report, emulate=emulate, cost_model=cost_model, spec=spec,
                     fast_math=fast_math, fusion=fusion, allow_tf32=allow_tf32)
            if stitched
            else default_pipeline(target))
    start = time.perf_counter()
    with target:
        lowered = pipe(tvm.IRModule(mod.functions, attrs=mod.attrs))
    executable = tvm.compile(lowered, target=target, relax_pipeline=None)
    return Built(executable, lowered, report, time.perf_counter() - start)


def cuda_launches(mod: tvm.IRModule, stitched: bool, arch: str = "sm_90", fusion: str = DEFAULT_FUSION) -> int:
    """CUDA kernel launches per call of `main` (no GPU needed: counts the built module)."""
    built = build(mod, {"kind": "cuda", "arch": arch}, stitched, fusion=fusion)
    return count_launches(built.lowered, built.executable)


def _flatten(result) -> list:
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [a for r in result for a in _flatten(r)]
    return [result.numpy()]


def run_cpu(executable, inputs: list) -> list:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return _flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))


ROUNDS = 5  # timing rounds per contender, alternating between contenders
ROUND_MS = 200.0  # each round calls a contender for at least this long


def python_round(fn, min_ms: float = ROUND_MS):
    """A round function for a Python callable: milliseconds per call over at least `min_ms`."""
    def one_round() -> float:
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = (time.perf_counter() - start) * 1e3
            if elapsed >= min_ms:
                return elapsed / calls
    return one_round


def vm_round(executable, inputs: list, min_ms: float = ROUND_MS):
    """A round function for `main` of a CPU executable: TVM's time evaluator, one repeat of at
    least `min_ms` (no Python call overhead)."""
    dev = tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    timer = vm.time_evaluator("main", dev, number=1, repeat=1, min_repeat_ms=int(min_ms))
    return lambda: timer(*args).mean * 1e3


def alternating_times(rounds_of: dict, rounds: int = ROUNDS) -> dict:
    """Median milliseconds per call of each contender (name -> round function returning the
    milliseconds per call of one round), over `rounds` rounds that visit the contenders in
    turn, in reverse order every other round, after one warm-up round each: a change of the
    machine's load or memory bandwidth touches every contender alike. A contender that raises
    gets NaN (Inductor failing on a graph is a result)."""
    live = {}
    for name, one_round in rounds_of.items():
        try:
            one_round()
            live[name] = one_round
        except Exception:  # noqa: BLE001 - see the docstring
            pass
    times = {name: [] for name in live}
    order = list(live.items())
    for k in range(rounds):
        for name, one_round in order if k % 2 == 0 else reversed(order):
            times[name].append(one_round())
    return {name: float(np.median(times[name])) if name in times else float("nan") for name in rounds_of}
