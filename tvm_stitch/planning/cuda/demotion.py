"""AStitch's demotion: shared intermediates recomputed in their consumers, one at a time, until a row fits."""

from __future__ import annotations

from tvm import tirx

from tvm_stitch.planning import row_resident as shared_rules
from tvm_stitch.planning.common import Analyses
from tvm_stitch.planning.cuda import row_resident
from tvm_stitch.planning.cuda.row_resident import SharedMemoryError
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec


def plan_demoting(func: tirx.PrimFunc, spec: TargetSpec, name: str, analyses: Analyses | None = None) -> StitchPlan:
    """The CUDA row-resident plan with as few intermediates demoted as make a row fit a block,
    largest first; the last SharedMemoryError when nothing is left to demote. `analyses`: views,
    trials and analyses shared with the other planners."""
    recompute = ()
    while True:
        try:
            analysis = shared_rules.analyse(func, spec.family, row_resident.LEVELS, recompute, analyses)
            return row_resident.plan(func, spec, name, recompute, analysis=analysis)
        except SharedMemoryError as err:
            if not err.demotable:
                raise
            recompute += (err.demotable[0],)
