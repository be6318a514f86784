"""What the arrival counters (schedules/cuda/arrivals.py) allow a plan: how many counters a CUDA module
has, and how many blocks of one launch may wait for the others."""

from __future__ import annotations

from tvm_stitch.planning.spec import TargetSpec

SLOTS = 1 << 16  # counters of one CUDA module: 256 KB of device memory, zero at load


def max_combining_blocks(spec: TargetSpec) -> int:
    """The most blocks of one launch that may wait for the others (fewer than the SMs: blocks that do
    not wait always free places for those still to run)."""
    return max(1, spec.sms // 2)
