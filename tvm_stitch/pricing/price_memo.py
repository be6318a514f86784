"""The modeled times of one module's kernels, memoised per structural key: a fused PrimFunc and a plan.

A module's repeated blocks (a model's layers, a chain of LayerNorms cut into
kernels of a few) outline to structurally equal PrimFuncs; the stitch pass
prices their plans once per module, not once per group or candidate. The key
is the fused PrimFunc's structural hash (equality checked) and the plan less
what names or records it (its kernel's name, notes, modeled traffic and time):
plans that schedule the same code the same way. `priced` counts the prices
computed (not those found).
"""

from __future__ import annotations

import dataclasses

import tvm_ffi
from tvm import tirx

from tvm_stitch.planning.plan import StitchPlan


def plan_key(plan: StitchPlan) -> str:
    """What of a plan decides its kernels' code: all but its name and what it records."""
    return dataclasses.replace(plan, kernel="", notes=(), modeled_bytes=-1, ideal_bytes=-1,
                               modeled_us=-1.0).to_json()


class PriceMemo:
    """KernelTimes (or None: not priced) per (fused PrimFunc, plan) of one module."""

    def __init__(self):
        self.entries: dict = {}  # (structural hash, plan key) -> [(fused, times)]
        self.priced = 0  # prices computed

    def times(self, fused: tirx.PrimFunc, plan: StitchPlan, price) -> list | None:
        """The times of `plan` for `fused`: found, or `price()` (the KernelTimes or None) kept."""
        found = self.entries.setdefault((tvm_ffi.structural_hash(fused), plan_key(plan)), [])
        for other, times in found:
            if tvm_ffi.structural_equal(other, fused):
                return times
        times = price()
        self.priced += 1
        found.append((fused, times))
        return times
