"""A model step in float16 or bfloat16 priced whole on CUDA: TVM's default build and the stitched one,
every kernel (GEMMs included) by the same time model (tools/module_time.py).

`price_step` imports the step (tools/model_bench.import_step), builds TVM's default pipeline on the
module TVM can build (model_bench.baseline_module: bfloat16 reductions widened first) and the stitch
pipeline on the module as imported, and prices both. `bound_mix` counts a build's launches by the part
of the model that bounds them (memory for the bandwidth part); `tensor_core_gemms` names the GEMMs
(compute kernels left to TVM's rules or the tensor-core rule) and those priced on a tensor-core unit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.model_bench import baseline_module, import_step
from tvm_stitch.tools.module_time import ModuleTime, default_module_time, stitched_module_time

BOUNDS = ("compute", "memory", "latency", "launch", "sfu", "serial")
TENSOR_CORE_UNITS = ("tf32_tc", "fp16_tc", "bf16_tc", "int8_tc")


@dataclass(frozen=True)
class PricedStep:
    model: str
    step: str
    dtype: str
    default: ModuleTime
    stitched: ModuleTime

    def ratio(self) -> float:
        """TVM default's modeled time over the stitched build's (0: one of them not priced)."""
        return self.default.us / self.stitched.us if self.default.us > 0 and self.stitched.us > 0 else 0.0


def price_step(model: str, step: str, dtype: str, target, size: str = "bench") -> PricedStep:
    """One step of `model` in `dtype`, both builds for the CUDA `target`, priced for its TargetSpec."""
    import tvm

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    spec = TargetSpec.from_target(target)
    mod, _, _ = import_step(model, step, size, dtype)
    default = default_module_time(baseline_module(mod, dtype), target, spec)
    return PricedStep(model, step, dtype, default, stitched_module_time(mod, target, spec))


def bound_mix(priced: ModuleTime) -> Counter:
    """Launches per bound (compute, memory, latency, launch, sfu, serial), calls counted."""
    mix = Counter()
    for _, calls, times in priced.kernels:
        for t in times:
            mix["memory" if t.bound == "bandwidth" else t.bound] += calls
    return mix


def tensor_core_gemms(priced: ModuleTime) -> tuple:
    """(GEMM PrimFuncs, those of them with every kernel's arithmetic on a tensor-core unit)."""
    gemms = sorted(name for name, _, _ in priced.kernels if name in priced.compute)
    times = {name: times for name, _, times in priced.kernels}
    on_tc = [name for name in gemms
             if all(any(unit in TENSOR_CORE_UNITS for unit, ops in (t.geometry.flops if t.geometry else ()) if ops)
                    for t in times[name])]
    return gemms, on_tc
