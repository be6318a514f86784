"""A schedule that is valid for any PrimFunc of loop nests: one kernel per block.

The last resort for functions that TVM's dlight rules cannot (or crash on)
schedule: each top-level block becomes its own kernel, its spatial loops
fused and spread over blocks of `block_threads` threads (the planners' choice,
within the target's limit), its reduction loops run serially inside each
thread. Slow for long reductions, never wrong.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block

from tvm_stitch.planning.common import block_threads
from tvm_stitch.planning.spec import TargetSpec

from ..common import loop_kinds


def _loop_kinds(sch: s_tir.Schedule, block) -> list:
    """(loop, is a reduction loop); every loop must be bound to one iterator."""
    out = []
    for loop, kind in loop_kinds(sch, block):
        if kind is None:
            raise ValueError(f"block {sch.get(block).name_hint}: loop {sch.get(loop).loop_var} "
                             "is not bound one-to-one")
        out.append((loop, kind == tirx.IterVar.CommReduce))
    return out


def apply(func: tirx.PrimFunc, spec: TargetSpec) -> s_tir.Schedule:
    """A schedule every PrimFunc gets: per block, its spatial loops fused over blocks of threads
    (at most `block_threads(spec)`), its reductions serial in each thread."""
    threads = block_threads(spec)
    sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(get_root_block(sch)):
        kinds = _loop_kinds(sch, block)
        spatial = [loop for loop, reduce in kinds if not reduce]
        reduce = [loop for loop, reduce in kinds if reduce]
        if spatial and reduce:
            sch.reorder(*spatial, *reduce)
        if spatial:
            fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        else:
            fused = sch.add_unit_loop(kinds[0][0] if kinds else block)
        outer, inner = sch.split(fused, [None, threads])
        sch.bind(outer, "blockIdx.x")
        sch.bind(inner, "threadIdx.x")
    return sch
