"""CUDA configurations chosen in time: variants of the rule plan scheduled, priced, the fastest kept.

The variants are planning/candidates.py's (threads per block, rows per
block, vector width, an on-chip intermediate recomputed in its consumers
instead of kept in shared memory, chunks per row of a row-split plan, row-split plans of rows a
row-resident rule leaves on too few blocks, column tiles). Priced are the plans of another scheme or
thread layout than the rule's, and the rule plan's neighbours:
the variants that change one knob, a count by at most a factor of
NEIGHBOURHOOD (threads per block by at most half fewer), the first
PRICED_NEIGHBOURS of them in candidates.py's order (a kernel of many
intermediates has as many recomputing variants: the bound keeps its compile
time from growing with them). Each is scheduled for the spec's CUDA arch and priced by the
time model (modeled_time.py); a neighbour that packs the same rows otherwise
into blocks (rows per block changed, 2 or more before and after) is priced
from the rule plan's lowered kernel, neither scheduled nor lowered
(plan_prices.py, derived_geometry.py). The rule plan is kept unless a variant is
more than TIE faster, and without a search where launch overhead is all
but TIE of its time (no variant could gain more); a variant that does not
schedule or cannot be priced is passed over (a derived neighbour is not
scheduled here: where the plan chosen does not build, the stitch pass builds
the rule plan). Every plan returned records its `modeled_us`.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from tvm_stitch.pricing.plan_prices import PlanPrices
from tvm_stitch.planning.candidates import candidates, knobs
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us

TIE = 0.02  # a variant must beat the rule plan's modeled time by more than this share
NEIGHBOURHOOD = 4  # a neighbour's threads or rows per block are within this factor of the rule's
PRICED_NEIGHBOURS = 12  # neighbours priced per kernel at most (models at test size: 8)


def choose_in_time(fused: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec,
                   prices: PlanPrices | None = None) -> StitchPlan:
    """The neighbour of `rule` with the lowest modeled time (the rule plan on ties), with its
    `modeled_us`; `prices`: the fused kernel's plans priced so far (made here if not given)."""
    prices = prices if prices is not None else PlanPrices(spec)
    times = prices.plan_times(fused, rule)
    rule_us = total_us(times) if times else -1.0
    priced = dataclasses.replace(rule, modeled_us=rule_us)
    if not times or rule.mapping.rows < 0 or sum(t.us - t.launch_us for t in times) <= TIE * rule_us:
        return priced
    plans = candidates(fused, rule, spec)
    best, best_us, chosen = priced, rule_us, 1
    neighbours = [(index, plan) for index, plan in enumerate(plans[1:], start=2) if _neighbour(plan, rule)]
    # Plans of another scheme (a split of rows the rule leaves on too few blocks), of another thread
    # layout (column tiles of rows that walk columns) or of another launch count (a row-split's phases
    # in one launch) are always priced.
    others = [(index, plan) for index, plan in enumerate(plans[1:], start=2)
              if plan.scheme != rule.scheme or plan.mapping.across != rule.mapping.across
              or plan.mapping.last_block_rows != rule.mapping.last_block_rows]
    for index, plan in others + neighbours[:PRICED_NEIGHBOURS]:
        neighbour = prices.plan_times(fused, plan)
        us = total_us(neighbour) if neighbour else -1.0
        if 0 <= us < best_us and us < rule_us * (1 - TIE):
            best, best_us, chosen = dataclasses.replace(plan, modeled_us=us), us, index
    if best is priced:
        return priced
    k = knobs(best)
    scheme = f"{best.scheme}, " if best.scheme != rule.scheme else ""
    note = (f"time model: candidate {chosen} of {len(plans)} ({scheme}{k['threads']} threads, "
            f"{k['rows_per_task']} rows per block, vector {k['vector']}, {best.mapping.split} chunks per row{_recomputed(best, rule)}), "
            f"{best_us:.1f} us against the rules' {rule_us:.1f} us")
    return dataclasses.replace(best, notes=best.notes + (note,))


def _neighbour(plan: StitchPlan, rule: StitchPlan) -> bool:
    """Whether `plan` changes one knob of `rule`, a count by at most NEIGHBOURHOOD times."""
    a, b = plan.mapping, rule.mapping
    changes = [a.threads != b.threads, a.rows_per_task != b.rows_per_task, a.vector != b.vector,
               plan.inlined() != rule.inlined(), a.split != b.split]
    near = all(max(x, y) <= NEIGHBOURHOOD * min(x, y)
               for x, y in ((a.threads, b.threads), (a.rows_per_task, b.rows_per_task), (a.split, b.split)))
    # Fewer threads leave each more unrolled work: past half the rule's, more registers than the
    # estimate (resources.py) allows for, and the occupancy the model takes from it would be wrong.
    return sum(changes) == 1 and near and 2 * a.threads >= b.threads


def _recomputed(plan: StitchPlan, rule: StitchPlan) -> str:
    before = set(rule.inlined())
    more = [name for name in plan.inlined() if name not in before]
    return f", recomputing {', '.join(more)}" if more else ""
