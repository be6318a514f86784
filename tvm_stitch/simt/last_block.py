"""A kernel whose last blocks combine (arrival counters) checked with the last block alone combining.

Blocks that wait for the others hold their place on a device that runs few
work-groups at once (pocl and Oclgrind on a few CPU cores): the blocks they
wait for may never start, and the wait gives up (simt/arrivals_opencl).
A mix-order plan whose partials `combining_blocks` > 1 blocks combine is
therefore rescheduled for the SIMT run with one combining block: the same
kernel 0, the same combine code, the share of every tile in the last block,
which waits for nothing.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.target import Target

from schedules import schedule_for
from tvm_stitch.planning.plan import StitchPlan


def last_block_combining(func: tirx.PrimFunc, fused: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """`func` (a stitched kernel of the fused PrimFunc `fused`) rescheduled with one combining block where
    its plan has more; else `func`."""
    plan = StitchPlan.from_json(str(func.attrs["tvm_stitch.plan"])) if "tvm_stitch.plan" in func.attrs else None
    if plan is None or plan.mapping.combining_blocks <= 1:
        return func
    plan = dataclasses.replace(plan, mapping=dataclasses.replace(plan.mapping, combining_blocks=1))
    scheduled = schedule_for(fused, plan, target).mod["main"]
    return scheduled.with_attrs({**{k: v for k, v in func.attrs.items()}, "tvm_stitch.plan": plan.to_json()})
