"""A function's compile-time budget: past it, its blocks are not searched and greedy's plans are used.

The fusion search (grouping/fusion_search.py) is an optimisation over greedy's
plan, which is built first; a function whose compile time has passed its
budget (fusion_search.FUNCTION_SECONDS) keeps greedy's plan for every block
not yet searched, and the report says so per block (its search line and a
note).
"""

from __future__ import annotations

import time

from tvm_stitch.grouping.fusion_search import over_budget


class FunctionBudget:
    """Seconds one Relax function may take before its blocks are no longer searched."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.perf_counter()

    def begin(self) -> None:
        """Start the budget of the next function."""
        self.started = time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def overrun(self, where: tuple, price: tuple, outcome) -> None:
        """Record in `outcome` that block `where` (function, index) keeps greedy's plan (greedy_price `price`)."""
        outcome.searches.append(over_budget(where, price))
        outcome.notes.append(f"{where[0]} block {where[1]}: not searched, the compile-time budget of "
                             f"{self.seconds:g} s per function is spent; greedy's plan is used")
