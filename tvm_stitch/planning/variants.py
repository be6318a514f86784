"""Size-dependent plans of a kernel whose row count is one symbolic size: which plan serves which sizes.

A kernel of a symbolic row count has one plan valid for every size (one row
per block, no row split). The rules plan a static count differently by size:
few long rows split over blocks, many short rows packed into a block. Here the
rules are evaluated at sample sizes within the size's bounds (SAMPLE_STEP
apart), consecutive samples whose plans agree (up to the row count) form a
range, and the plan made for the top of each range serves every size in it.
Plain data only: the ranges and their conditions; kernels/variants.py builds
and dispatches them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tvm_stitch.planning.plan import StitchPlan

SAMPLE_STEP = 8  # consecutive sample sizes differ by this factor
UNBOUNDED_POWER = 7  # a size without an upper bound is planned up to SAMPLE_STEP ** UNBOUNDED_POWER
MAX_VARIANTS = 3  # size-dependent plans compiled besides the plan valid for every size


@dataclass(frozen=True)
class SizeRange:
    """The sizes a variant serves: `low` <= size <= `high` (None: no bound), a multiple of `multiple`."""

    size: str
    low: int | None = None
    high: int | None = None
    multiple: int = 1

    def holds(self, value: int) -> bool:
        return ((self.low is None or value >= self.low) and (self.high is None or value <= self.high)
                and value % self.multiple == 0)

    def holds_within(self, low: int | None, high: int | None) -> bool:
        """Whether some size within the bounds `low` <= size <= `high` (None: no bound; sizes are at
        least 1) holds."""
        first = max(1, low or 1, self.low or 1)
        last = min(v for v in (high, self.high) if v is not None) if (high, self.high) != (None, None) else None
        start = -(-first // self.multiple) * self.multiple
        return last is None or start <= last

    def text(self) -> str:
        parts = ([f"{self.size} >= {self.low}"] if self.low is not None else []) + (
            [f"{self.size} <= {self.high}"] if self.high is not None else []) + (
            [f"{self.size} % {self.multiple} == 0"] if self.multiple > 1 else [])
        return " and ".join(parts) or "every size"


@dataclass(frozen=True)
class Variant:
    """A plan and the sizes it serves; `at` is the size it was planned (and priced) for."""

    condition: SizeRange
    plan: StitchPlan
    at: int = -1


def sample_sizes(low: int | None, high: int | None) -> list:
    """Sizes to plan at: the lower bound (at least 1), the powers of SAMPLE_STEP above it and below
    the upper bound, and the upper bound (without one: up to SAMPLE_STEP ** UNBOUNDED_POWER)."""
    first = max(1, low or 1)
    last = high if high is not None else SAMPLE_STEP ** UNBOUNDED_POWER
    out = [first]
    size = SAMPLE_STEP
    while size < last:
        if size > first:
            out.append(size)
        size *= SAMPLE_STEP
    return out + ([last] if last > first else [])


def sampled_plans(samples: list, plan_at) -> list:
    """The plan at each sample (`plan_at(size)`), planned at the ends and, by bisection, between
    two planned samples whose plans differ: samples between two that agree take their plan (the
    rules change a plan monotonically with the row count: split few rows, pack many)."""
    plans = {0: plan_at(samples[0]), len(samples) - 1: plan_at(samples[-1])}
    pending = [(0, len(samples) - 1)]
    while pending:
        first, last = pending.pop()
        if last - first < 2 or key(plans[first]) == key(plans[last]):
            continue
        middle = (first + last) // 2
        plans[middle] = plan_at(samples[middle])
        pending += [(first, middle), (middle, last)]
    out, current = [], plans[0]
    for index in range(len(samples)):
        current = plans.get(index, current)
        out.append(current)
    return out


def key(plan: StitchPlan) -> tuple:
    """What makes two plans of one kernel the same code, whatever their row count."""
    m = plan.mapping
    return (plan.scheme, plan.rank, m.rows_per_task, m.threads, m.vector, m.split, m.across, plan.kernels,
            tuple((i.name, i.level, i.inlined) for i in plan.intermediates), plan.cached_inputs, plan.phases)


def packs_with_barriers(plan: StitchPlan) -> bool:
    """Rows packed into a block whose threads meet at barriers: only whole blocks, so the row
    count must be a multiple of the rows per block."""
    return plan.mapping.rows_per_task > 1 and plan.mapping.threads > 1


def ranges(size: str, samples: list, plans: list, general: StitchPlan) -> list:
    """(SizeRange, sample size, plan planned there) of each run of consecutive samples whose plans
    differ from `general` and agree with each other: from above the previous sample to the run's top
    (no upper bound for the last run, no lower one for the first), planned at the top."""
    out = []
    for index, (sample, plan) in enumerate(zip(samples, plans)):
        last = index == len(samples) - 1
        same_as_next = not last and key(plans[index + 1]) == key(plan)
        if key(plan) != key(general) and not same_as_next:
            start = _run_start(samples, plans, index)
            multiple = plan.mapping.rows_per_task if packs_with_barriers(plan) else 1
            low = None if start == 0 else samples[start - 1] + 1
            out.append((SizeRange(size, low, None if last else sample, multiple), sample, plan))
    return out


def _run_start(samples: list, plans: list, index: int) -> int:
    start = index
    while start > 0 and key(plans[start - 1]) == key(plans[index]):
        start -= 1
    return start


def symbolic(plan: StitchPlan, row_shape: tuple) -> StitchPlan:
    """A plan made for a static row count, as the plan of the symbolic count `row_shape`."""
    mapping = dataclasses.replace(plan.mapping, rows=-1, grid=-1)
    return dataclasses.replace(plan, mapping=mapping, row_shape=tuple(row_shape))


def merged(variants: tuple) -> tuple:
    """`variants` (in the dispatch's order) with consecutive ones of the same code joined: a plan
    chosen for a range the same as the next range's (up to the row count), the sizes of both
    adjoining, serves both under one condition, compiled once."""
    out = []
    for variant in variants:
        last = out[-1] if out else None
        if (last is not None and key(last.plan) == key(variant.plan) and last.condition.high is not None
                and variant.condition.low == last.condition.high + 1
                and last.condition.multiple == variant.condition.multiple):
            condition = dataclasses.replace(last.condition, high=variant.condition.high)
            out[-1] = dataclasses.replace(variant, condition=condition)
        else:
            out.append(variant)
    return tuple(out)


def selected(variants: tuple, value: int) -> Variant | None:
    """The first variant whose condition holds at `value` (the dispatch's order)."""
    return next((v for v in variants if v.condition.holds(value)), None)
