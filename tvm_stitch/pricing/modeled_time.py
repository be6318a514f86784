"""The modeled time of a scheduled CUDA PrimFunc: its kernels' geometry priced by the time model.

Each kernel's geometry comes from the lowered TIR (kernel_geometry.py), its
device-memory bytes from the PrimFunc's modeled traffic (traffic.py) shared
among its kernels (a contraction left to TVM's rules: its tiles' traffic with
L2 reuse, contraction.py); a PrimFunc of symbolic sizes is priced at the upper
bounds of its sizes where all have one (as its traffic is), else not at all.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.target import Target

from schedules import schedule_for
from tvm_stitch.analysis.size_bounds import at_upper_bounds
from tvm_stitch.pricing.contraction import as_contraction, is_contraction
from tvm_stitch.pricing.kernel_geometry import UnsupportedGeometry, kernel_geometries
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import kernel_time, total_us


def cuda_target(spec: TargetSpec) -> Target:
    """The CUDA target a spec's kernels are lowered for when they are priced."""
    return Target({"kind": "cuda", "arch": spec.arch})


def modeled_times(func: tirx.PrimFunc, spec: TargetSpec, registers: int = -1, name: str = "") -> list | None:
    """The KernelTime of each kernel of `func` (scheduled for CUDA), in launch order; None when
    its sizes are symbolic without upper bounds or its geometry cannot be read. `registers`: per
    thread (the plan's estimate; -1: time_model.DEFAULT_REGISTERS); `name`: the kernels' stem."""
    traffic = modeled_traffic(func, spec)
    if traffic is None:
        func, _ = at_upper_bounds(func)
        traffic = modeled_traffic(func, spec) if func is not None else None
        if traffic is None:
            return None
    geometries = lowered_geometries(func, spec, registers, traffic.total, name)
    if geometries is None:
        return None
    if is_contraction(func, registers):
        geometries = as_contraction(geometries, traffic, spec)
    return [kernel_time(g, spec) for g in geometries]


def lowered_geometries(func: tirx.PrimFunc, spec: TargetSpec, registers: int, dram_bytes: int,
                       name: str = "") -> list | None:
    """kernel_geometries of a static PrimFunc scheduled for CUDA, lowered for the spec's arch;
    None where TVM's lowering fails or a kernel's geometry cannot be read."""
    try:
        return kernel_geometries(func, cuda_target(spec), registers, dram_bytes, name)
    # TVM's lowering errors: tvm.error.InternalError (a RuntimeError), TypeError, ValueError
    except (UnsupportedGeometry, RuntimeError, TypeError, ValueError):
        return None


def plan_times(fused: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> list | None:
    """modeled_times of `plan`'s kernels for a fused PrimFunc, scheduled here for the spec's CUDA
    arch; None where the plan does not schedule or its kernels cannot be priced."""
    try:
        scheduled = schedule_for(fused, plan, cuda_target(spec)).mod["main"]
    except Exception:  # noqa: BLE001 - a variant s_tir refuses has no time
        return None
    return modeled_times(scheduled, spec, plan.registers, plan.kernel)


def plan_us(fused: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> float:
    """Modeled microseconds of `plan_times`; -1.0 where not priced."""
    times = plan_times(fused, plan, spec)
    return total_us(times) if times else -1.0


def scheduled_us(scheduled: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> float:
    """Modeled microseconds of a PrimFunc scheduled for CUDA by `plan`; -1.0 where not priced."""
    times = modeled_times(scheduled, spec, plan.registers, plan.kernel)
    return total_us(times) if times else -1.0


def with_modeled_time(plan: StitchPlan, fused: tirx.PrimFunc, spec: TargetSpec,
                      scheduled: tirx.PrimFunc | None = None) -> StitchPlan:
    """`plan` with its modeled time where it is a CUDA plan not yet priced: from `scheduled` (its kernel
    built for CUDA) where given, else from `fused` scheduled for the spec's arch (plan_us)."""
    if spec.family != "cuda" or plan.modeled_us >= 0:
        return plan
    us = scheduled_us(scheduled, plan, spec) if scheduled is not None else plan_us(fused, plan, spec)
    return dataclasses.replace(plan, modeled_us=us)
