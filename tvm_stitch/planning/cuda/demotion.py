"""AStitch's demotion: shared intermediates recomputed in their consumers, one at a time, until a row fits."""

from __future__ import annotations

from tvm import tirx

from tvm_stitch.planning.cuda import row_resident
from tvm_stitch.planning.cuda.row_resident import SharedMemoryError
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec


def plan_demoting(func: tirx.PrimFunc, spec: TargetSpec, name: str) -> StitchPlan:
    """The CUDA row-resident plan with as few intermediates demoted as make a row fit a block,
    largest first; the last SharedMemoryError when nothing is left to demote."""
    recompute = ()
    while True:
        try:
            return row_resident.plan(func, spec, name, recompute)
        except SharedMemoryError as err:
            if not err.demotable:
                raise
            recompute += (err.demotable[0],)
