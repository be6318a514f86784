"""Packing on CUDA decided in time: which column sums share a launch as their thread-per-column
walks, and which packs are built at all.

Packing saves launch overheads (spec.launch_us each), and the time model
prices a packed launch as its members' waves one after the other at the
launch's occupancy (planning/time_model.py). So:
- a one-launch column-split kernel is replaced by its thread-per-column walk
  (to share a launch with kernels of another block shape) only where the
  walk, its launch overhead saved, is modeled no slower: a walk runs each
  column's rows serially in one thread, so over many rows it is latency-bound
  far beyond a launch overhead;
- a pack is built only where its modeled time is not above its members'
  apart (its occupancy can fall: registers and shared memory are the
  largest member's). A pack or member that cannot be priced keeps the
  launch-count rule.
"""

from __future__ import annotations

from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us


def walk_in_time(walk: StitchPlan, column_split: StitchPlan, spec: TargetSpec) -> bool:
    """Whether `walk`, in a pack (its launch overhead saved), is modeled no slower than the
    column-split plan it would replace; True where either is not priced or not for CUDA."""
    if spec.family != "cuda" or walk.modeled_us < 0 or column_split.modeled_us < 0:
        return True
    return walk.modeled_us - spec.launch_us <= column_split.modeled_us


def pack_in_time(packed, members: list, spec: TargetSpec) -> bool:
    """Whether the packed PrimFunc `packed` (scheduled for CUDA) is modeled no slower than its
    member plans' launches apart; True where the pack or a member is not priced."""
    apart = [plan.modeled_us for plan in members]
    if any(us < 0 for us in apart):
        return True
    times = modeled_times(packed, spec, max(plan.registers for plan in members))
    return times is None or total_us(times) <= sum(apart)
