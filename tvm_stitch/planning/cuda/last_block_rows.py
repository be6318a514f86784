"""A two-phase row-split plan in one launch (schedules/cuda/last_block_rows): the twin of a plan of two
launches whose phase 1 each row's last block to arrive runs over the whole row, priced beside it.

Offered for two phases (three keep their launches: see the schedule), rows
cut over blocks with a block's threads along them (a column walk keeps its
launches) and one counter slot per row. Nothing waits for a block that has
not arrived, so no limit on blocks per row applies.
"""

from __future__ import annotations

import dataclasses

from tvm_stitch.planning.cuda.arrival_limits import SLOTS
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.resources import with_resources


def last_block_plan(plan: StitchPlan) -> StitchPlan | None:
    """`plan` (row-split, two launches) in one launch; None where it does not qualify."""
    m = plan.mapping
    if (plan.scheme != "row-split" or plan.kernels != 2 or m.last_block_rows or m.threads == 1 or m.split < 2
            or not 0 < m.rows <= SLOTS):
        return None
    note = ("one launch for both phases: each row's last block to arrive (an arrival counter per row) runs "
            "phase 1 over the whole row")
    return with_resources(dataclasses.replace(plan, kernels=1, mapping=dataclasses.replace(m, last_block_rows=True),
                                              notes=plan.notes + (note,)))


def last_block_plans(plans: list) -> list:
    """The one-launch twins of `plans` that have one."""
    return [twin for twin in (last_block_plan(p) for p in plans) if twin is not None]
