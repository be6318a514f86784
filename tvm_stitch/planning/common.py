"""What the row-resident and row-split planners share.

The analysis of a fused PrimFunc both start from (its blocks, the blocks
that write its outputs, the blocks left once some are inlined, the check
that every block is a plain loop nest accessing elements one by one), the CUDA
launch heuristics both follow (threads per block, blocks wanted per SM),
and the rewrites a plan's trial and its schedule both make (outputs
recomputed by their readers, cache stages in their producer's order).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_stitch.analysis.tir_view import REGION, block_views, buffer_params, function_views, node_count
from tvm_stitch.planning.reasons import PlanError
from tvm_stitch.planning.spec import TargetSpec

BLOCK_THREADS = 256  # threads per CUDA block at most: enough warps per block, several blocks per SM
BLOCKS_PER_SM = 2  # CUDA blocks wanted per SM, so one block's barrier leaves the SM busy
# Expression nodes a block may reach once its producers are inlined: an element-wise chain whose
# values are each read several times grows exponentially (s_tir's inlining and the codegens then
# take minutes); the models' largest stitched block stays under a thousand.
INLINED_NODES_MAX = 100_000


def block_threads(spec: TargetSpec) -> int:
    """Threads per CUDA block the plans use at most."""
    return min(BLOCK_THREADS, spec.max_threads_per_block)


def wanted_blocks(spec: TargetSpec) -> int:
    """CUDA blocks that fill the GPU: BLOCKS_PER_SM per SM."""
    return BLOCKS_PER_SM * spec.sms


def output_blocks(views: list, func: tirx.PrimFunc) -> set:
    """Names of the blocks that write a parameter of `func` (the kernel's outputs)."""
    params = buffer_params(func)
    return {v.name for v in views if any(w.buffer.same_as(p) for w in v.writes for p in params)}


def check_describable(views: list, error: type = PlanError) -> None:
    """Raise `error` unless every block is one loop per iterator that accesses elements one by one:
    at a point of its iterators, or through computed indices (gathers: whether such a read may
    cross rows is the row alignment's question)."""
    if not views:
        raise error("no-blocks")
    for view in views:
        if not view.trivial_binding:
            raise error("loop-nest", block=view.name)
        for access in view.reads + view.writes:
            if access.kind == REGION:
                role = "writes" if any(access is w for w in view.writes) else "reads"
                raise error("region-access", block=view.name, role=role, buffer=access.buffer.name)


class Analyses:
    """The block views, inlining trials and analyses of fused PrimFuncs, each made once: shared by
    the planners that plan one kernel (`planner.plan_kernel`: row-split, column-split and
    row-resident each inline the same blocks) and by the candidates of one choice. Keyed by the
    PrimFunc object and what was made of it; a PlanError raised while making it is raised again."""

    def __init__(self):
        self._made = []  # (func, key, value, PlanError or None)

    def made(self, func: tirx.PrimFunc, key: tuple, make):
        """`make()`, or what it gave (or raised) for `func` and `key` before."""
        for other, other_key, value, error in self._made:
            if other_key == key and other.same_as(func):
                break
        else:
            try:
                value, error = make(), None
            except PlanError as err:
                value, error = None, err
            self._made.append((func, key, value, error))
        if error is not None:
            raise error
        return value


def views(func: tirx.PrimFunc, analyses: Analyses | None = None) -> list:
    """`function_views(func)`, made once per `analyses`."""
    if analyses is None:
        return function_views(func)
    return analyses.made(func, ("views",), lambda: function_views(func))


def inline_trial(func: tirx.PrimFunc, names: list, error: type = PlanError, analyses: Analyses | None = None) -> tuple:
    """(schedule, views) of `func` with the blocks `names` inlined, last first; `error` names a
    block s_tir refuses to inline. The schedule is read, not changed, by its users: one trial per
    `analyses` and blocks."""
    made = (_trial(func, tuple(names), analyses) if analyses is None else
            analyses.made(func, ("trial",) + tuple(names), lambda: _trial(func, tuple(names), analyses)))
    if isinstance(made, _Refused):
        raise error("not-inlinable", block=made.block, detail=made.detail)
    return made


@dataclass(frozen=True)
class _Refused:
    """A block s_tir refused to inline, and its last line of why."""

    block: str
    detail: str


def inlined_sizes(func: tirx.PrimFunc, names: tuple) -> dict:
    """Expression nodes of each block of `func` once the blocks `names` are inlined into their
    readers (each read of an inlined block's buffer replaced by its whole expression)."""
    blocks = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append), order="pre")
    writer = {w.source: b.name_hint for b in blocks for w in b.writes}  # by buffer: names repeat
    sizes = {}
    for block in blocks:
        nested, grown = [], []
        tvm_ffi.structural_walk(block.body, (s_tir.SBlockRealize, nested.append), order="pre")
        if nested:  # the root block holds the others: each counts on its own
            continue
        tvm_ffi.structural_walk(block.body, (tvm.ir.TensorLoad, lambda load: grown.append(
            sizes.get(writer[load.source], 1) - 1 if writer.get(load.source) in names else 0)), order="pre")
        sizes[block.name_hint] = node_count(block.body) + sum(grown)
    return sizes


def _trial(func: tirx.PrimFunc, names: tuple, analyses: Analyses | None):
    grown = {b: n for b, n in inlined_sizes(func, names).items() if n > INLINED_NODES_MAX}
    if grown:
        block = max(grown, key=grown.get)
        return _Refused(block, f"inlining its producers grows its expression to {grown[block]} nodes "
                               f"(at most {INLINED_NODES_MAX})")
    trial = s_tir.Schedule(func)
    for name in reversed(names):
        try:
            trial.compute_inline(trial.get_sblock(name))
        except Exception as err:  # noqa: BLE001 - s_tir refuses the inlining: say which block
            return _Refused(name, str(err).strip().splitlines()[-1][:120])
    return trial, block_views(trial) if names else views(func, analyses)


def recompute_in_readers(sch: s_tir.Schedule, names: tuple) -> None:
    """Let the blocks that read each element-wise output block of `names` recompute its value
    instead of loading the output (row-split: a per-row mean that another block of the same
    kernel would otherwise read before it is written). The output is then written by a copy
    stage (s_tir names it after the block's buffer) that computes the value too."""
    for name in names:
        block = sch.get_sblock(name)
        stage = sch.cache_write(block, 0, "global", consumer_blocks=sch.get_consumers(block))
        rows_first_in_stage(sch, block, stage, len(sch.get(block).iter_vars))
        sch.compute_inline(block)


def rows_first_in_stage(sch: s_tir.Schedule, producer, stage, rank: int) -> None:
    """Bring the row iterators of a cache stage first (`stage`: the copy `cache_write` made of
    `producer`'s result, iterating over the parameter's layout).

    Where the rows are not the parameter's leading dimensions (plan.row_axes), the copy's
    leading iterators are not rows; the producer's first `rank` iterators name the
    dimensions that are (all of an element-wise producer's: the copy then iterates in its order).
    """
    node = sch.get(producer)
    row_vars = [iv.var for iv in node.iter_vars[:rank]]
    indices = [r.min for r in node.writes[0].region]
    dims = []
    for var in row_vars:
        found = [d for d, index in enumerate(indices) if isinstance(index, tirx.Var) and index.same_as(var)]
        if len(found) != 1:
            return
        dims.append(found[0])
    if dims == list(range(rank)):
        return
    iters = sch.get(stage).iter_vars

    def moved(*ivs):
        return tuple(ivs[d] for d in dims) + tuple(v for d, v in enumerate(ivs) if d not in dims)

    sch.transform_block_layout(stage, tirx.IndexMap.from_func(moved, ndim=len(iters),
                                                              index_dtype=str(iters[0].var.ty)))
