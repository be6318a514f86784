"""Row-resident stitching on the CPU: row tasks in parallel over cores.

The same plan as on CUDA: every block runs under the merged row loop, which
is parallel across cores; each row's intermediates are computed once into a
per-row buffer (TVM compacts the allocation to one row) that stays in cache,
and cheap ones are inlined. Element-wise loops inside a row are vectorised
by the plan's lane count where the row length allows.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from tvm_stitch.plan import StitchPlan
from tvm_stitch.tir_view import expensive_ops

from ..common import blocks_by_name, inline_cheap_blocks, merge_row_loops, within_row_loops


def _calls_expensive(sch: s_tir.Schedule, block) -> bool:
    """LLVM scalarises libm calls inside vector loops, which is slower than a scalar loop."""
    return bool(expensive_ops(sch.get(block).body))


def apply(func: tirx.PrimFunc, plan: StitchPlan, target: Target) -> s_tir.Schedule:
    del target
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch, plan)
    row = merge_row_loops(sch, plan)
    if plan.mapping.threads > 1 and plan.mapping.rows != 1:
        sch.parallel(row)
    lanes = plan.mapping.vector
    for block in blocks_by_name(sch).values():
        spatial, reduce = within_row_loops(sch, block, row)
        if reduce or not spatial:
            continue
        loop = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        extent = sch.get(loop).extent
        if lanes > 1 and isinstance(extent, tirx.IntImm) and extent.value % lanes == 0:
            _, inner = sch.split(loop, [None, lanes])
            sch.vectorize(inner)
    return sch
