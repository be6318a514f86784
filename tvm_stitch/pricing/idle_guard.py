"""The idle guard: a stitched CUDA kernel that moves much and is modeled far under the peak says why.

A kernel that moves IDLE_BYTES or more of device memory and is modeled under
IDLE_SHARE of its arch's peak bandwidth carries a reason code (planning/reasons.py)
naming why no fuller plan exists, read from its priced launches, in this order:
- `idle-launch-bound`: the launch overhead is half its time or more (no plan
  shortens a launch);
- `idle-few-rows` / `idle-middle-axis`: a launch taking a quarter of its time or
  more has less than one wave of resident blocks (the rows, or the columns of a
  reduction over a middle axis, give no more blocks), with the row-split scheme's
  verdict on cutting the rows over blocks;
- `idle-launch-cap`: its launches' overhead plus its bytes at the achievable
  bandwidth already take more than its bytes at IDLE_SHARE of the peak: no plan of
  as many launches reaches the share (a kernel of 12.6 MB in one launch: 44% at most);
- `idle-latency-bound`: its slowest launch waits on DRAM round trips (the loads a
  thread keeps in flight, a round trip per barrier-separated phase that loads, in
  every wave) more than on bandwidth, and the time model chose it among its candidates.
A kernel idle for none of these causes gets no reason: tests flag it.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from tvm_stitch.analysis.tir_view import static_product
from tvm_stitch.planning.candidates import candidates
from tvm_stitch.planning.common import Analyses, PlanError
from tvm_stitch.planning.common import views as views_of
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.reasons import Reason
from tvm_stitch.planning.row_split import plan_row_split
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import peak_bytes_per_us, resident_blocks
from tvm_stitch.pricing.modeled_time import modeled_times, plan_times

IDLE_BYTES = 4_000_000  # a kernel moving this much device memory or more is guarded
IDLE_SHARE = 0.5  # ... when modeled under this share of the arch's peak bandwidth


def bandwidth_share(plan: StitchPlan) -> float:
    """The plan's modeled bytes over its modeled time, as a share of its arch's peak bandwidth;
    -1.0 where not modeled."""
    if plan.spec is None or plan.modeled_us <= 0 or plan.modeled_bytes < 0:
        return -1.0
    return plan.modeled_bytes / plan.modeled_us / peak_bytes_per_us(plan.spec)


def is_idle(plan: StitchPlan) -> bool:
    """Whether the guard applies: a modeled CUDA plan moving IDLE_BYTES or more under IDLE_SHARE."""
    return plan.target == "cuda" and plan.modeled_bytes >= IDLE_BYTES and 0 <= bandwidth_share(plan) < IDLE_SHARE


def with_idle_reason(plan: StitchPlan, fused: tirx.PrimFunc, spec: TargetSpec,
                     scheduled: tirx.PrimFunc | None = None) -> StitchPlan:
    """`plan` with the reason it leaves bandwidth idle where the guard applies (`scheduled`: its
    kernel built for CUDA, else `fused` is scheduled for the spec's arch to price it)."""
    if spec.family != "cuda" or not is_idle(plan):
        return plan
    times = (modeled_times(scheduled, spec, plan.registers, plan.kernel) if scheduled is not None
             else plan_times(fused, plan, spec))
    if not times:
        return plan
    reason = idle_reason(plan, fused, spec, times)
    return dataclasses.replace(plan, idle=reason) if reason is not None else plan


def idle_reason(plan: StitchPlan, fused: tirx.PrimFunc, spec: TargetSpec, times: list) -> Reason | None:
    """The reason code of an idle plan from its launches' KernelTimes; None where none applies."""
    total = sum(t.us for t in times)
    launch = sum(t.launch_us for t in times)
    if 2 * launch >= total:
        return Reason("idle-launch-bound", {
            "us": round(total, 2), "launch_us": round(launch, 2),
            "bandwidth_us": round(sum(t.bandwidth_us for t in times), 2), "launches": len(times)})
    under = [t for t in times if t.geometry.grid < resident_blocks(t.geometry, spec)[0] and t.us * 4 >= total]
    if under:
        slowest = max(under, key=lambda t: t.us)
        per_wave, _ = resident_blocks(slowest.geometry, spec)
        code = "idle-middle-axis" if plan.scheme == "column-split" or plan.row_axes else "idle-few-rows"
        return Reason(code, {
            "rows": plan.mapping.rows, "length": _row_length(fused, plan), "blocks": slowest.geometry.grid,
            "threads": slowest.launched_threads, "resident": per_wave * slowest.geometry.threads,
            "candidates": len(candidates(fused, plan, spec)), "split": _split_verdict(fused, plan, spec)})
    cap = _launch_cap(plan, spec, len(times))
    if cap < IDLE_SHARE:
        return Reason("idle-launch-cap", {
            "launches": len(times), "mb": round(plan.modeled_bytes / 1e6, 1), "launch_us": round(launch, 2),
            "bytes_us": round(plan.modeled_bytes / spec.hbm_bytes_per_us, 2), "cap": round(cap, 3)})
    slowest = max(times, key=lambda t: t.us)
    if slowest.bound == "latency":
        geometry = slowest.geometry
        return Reason("idle-latency-bound", {
            "us": round(total, 2), "latency_us": round(sum(t.latency_us for t in times), 2),
            "bandwidth_us": round(sum(t.bandwidth_us for t in times), 2),
            "loads": sum(count for _, count in geometry.loads), "phases": geometry.load_phases,
            "waves": slowest.waves + (1 if slowest.tail else 0), "candidates": len(candidates(fused, plan, spec))})
    return None


def _launch_cap(plan: StitchPlan, spec: TargetSpec, launches: int) -> float:
    """The highest share of the peak bandwidth a plan of `launches` launches moving the plan's bytes can be
    modeled at: its bytes at the peak over the launch overheads plus the bytes at the achievable bandwidth."""
    floor = launches * spec.launch_us + plan.modeled_bytes / spec.hbm_bytes_per_us
    return plan.modeled_bytes / peak_bytes_per_us(spec) / floor


def _row_length(fused: tirx.PrimFunc, plan: StitchPlan) -> int:
    """Elements per row task: the largest block's iteration space over the plan's rows (-1: symbolic)."""
    sizes = [static_product(v.extents) for v in views_of(fused)]
    if plan.mapping.rows <= 0 or not sizes or any(s is None for s in sizes):
        return -1
    return max(sizes) // plan.mapping.rows


def _split_verdict(fused: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> str:
    """What the row-split scheme says of cutting the rows over blocks: its refusal, or the plan it offers."""
    if plan.scheme == "row-split" and plan.mapping.last_block_rows:
        return (f"split {plan.mapping.split} chunks per row already, phase 1 run by each row's last block "
                f"({plan.mapping.rows} blocks) to keep one launch")
    if plan.scheme == "row-split":
        return f"split {plan.mapping.split} chunks per row already"
    try:
        split = plan_row_split(fused, spec, plan.kernel, few_long_rows_only=True, analyses=Analyses())
    except PlanError as err:
        return err.reason.text
    return f"a row-split plan of {split.mapping.grid} blocks in {split.kernels} kernels, not chosen"
