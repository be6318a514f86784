"""A stitched kernel over Oclgrind's resources, checked as planned within them.

Oclgrind simulates a device of 32 KB local memory. A CUDA plan may use more
shared memory than that (48 KB a block on every arch), and TVM's OpenCL
lowering adds a local-memory tree per cross-thread reduction (threads x
rows per block values, where CUDA shuffles within warps): such a launch
fails with OUT_OF_RESOURCES, a size the simulator cannot hold rather than
a construct the checker cannot run. The kernel's fused PrimFunc is then
planned again by the product's planner and schedule rules for the plans'
TargetSpec with the shared memory of a block capped at the device's local
memory and, where that is not enough, half the threads per block at a
time (fewer threads and rows per block, so a smaller tree), and the first
plan that runs is checked instead; the result says so.
"""

from __future__ import annotations

import dataclasses

from schedules import schedule_for
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import TargetSpec


def over_resources(status: str, detail: str) -> bool:
    """The check stopped because the device could not hold the launch (OUT_OF_RESOURCES)."""
    return status == "unsupported" and "OUT_OF_RESOURCES" in detail


def fitting_specs(spec: TargetSpec, device) -> list:
    """`spec` with a block's shared memory capped at `device`'s local memory, then also with half
    the threads per block each time, down to one warp."""
    shared = min(spec.shared_bytes_per_block, int(device.local_mem_size))
    threads = min(spec.max_threads_per_block, int(device.max_work_group_size))
    out = []
    while threads >= spec.warp_size:
        out.append(dataclasses.replace(spec, shared_bytes_per_block=shared, max_threads_per_block=threads))
        threads //= 2
    return out


def replanned(fused, name: str, spec: TargetSpec, target):
    """(scheduled PrimFunc, plan) of `fused` planned for `spec` by the product's rules (no cost model)."""
    plan = plan_kernel(fused, spec, name)
    scheduled = schedule_for(fused, plan, target).mod["main"]
    return scheduled.with_attrs({"tirx.is_scheduled": True, "tvm_stitch.plan": plan.to_json()}), plan


def describe(spec: TargetSpec, plan) -> str:
    """How the kernel that ran was planned, for the check's detail."""
    m = plan.mapping
    return (f"over Oclgrind's local memory as planned: checked as planned for "
            f"{spec.shared_bytes_per_block // 1024} KB shared and {spec.max_threads_per_block} threads a block "
            f"({plan.scheme}, {m.threads} threads x {m.rows_per_task} rows a block, "
            f"{plan.shared_bytes} B shared)")
