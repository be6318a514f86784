"""Column tiles: row-resident plans of rows that walk columns (a reduction over a middle axis) that fill the GPU.

A mean over the middle axis of x (B, R, C) followed by element-wise work on
x (`exp(x - mean)`) has B x C rows of R elements, each row a column of
stride C. The rule plan gives each row one thread (consecutive threads on
consecutive columns keep loads coalesced): B x C threads, each walking R
elements twice, far under one wave (64 x 32 = 2048 threads for 64x1024x32).

A column-tile plan keeps the kernel one launch and cuts each row over
threads instead:
- a block takes `tile` consecutive rows (columns c..c+tile of one b), one per
  `threadIdx.x` (a tile of at least one 32-byte sector per R step, so the
  loads of a warp stay coalesced);
- the row's `threads` threads go along `threadIdx.y`, each summing every
  `threads`-th element of the row; the block combines them in shared memory
  (TVM's cross-thread reduction over `threadIdx.y`, one group per column);
- the reduction's result and the inputs read by several blocks (x) are kept
  in shared memory per row where they fit, so x is read from device memory once.

ThreadMapping records it as `across` (rows across `threadIdx.x`). The
time model chooses among the tiles and thread counts (candidates.py): they
are offered where the rule plan is a thread per column row of a reduction
under one wave of resident threads.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from tvm_stitch.analysis.row_axes import ROW_AXES_ATTR, rows_first
from tvm_stitch.planning.common import PlanError
from tvm_stitch.planning.cuda import row_resident as cuda_rows
from tvm_stitch.planning.cuda.launch import widest_bytes
from tvm_stitch.planning.cuda.row_resident import CudaRowMapping
from tvm_stitch.planning.plan import REGISTER, SHARED, Intermediate, StitchPlan, ThreadMapping
from tvm_stitch.planning.resources import cuda_shared_bytes, with_resources
from tvm_stitch.planning.row_resident import analyse, assemble, choose_rows, intermediates
from tvm_stitch.planning.spec import TargetSpec

SECTOR_BYTES = 32  # a tile's row step spans at least one global-memory sector
TILE_SECTORS = (1, 2)  # tiles tried: this many sectors of columns per block
ROW_THREADS = (32, 64, 128)  # threads along a row tried (fewer leave each thread a latency-bound walk)
MIN_PER_THREAD = 4  # elements of its row a thread sums at least


def offered(rule: StitchPlan, spec: TargetSpec) -> bool:
    """Whether column tiles are tried for `rule`: a CUDA row-resident plan of a thread per row that
    reduces rows walking columns (moved first), launching less than a wave of resident threads."""
    m = rule.mapping
    return (rule.target == "cuda" and rule.scheme == "row-resident" and bool(rule.row_axes) and m.threads == 1
            and not m.across and rule.reductions > 0 and not rule.bounds and m.rows > 0 and m.row_elements > 1
            and m.rows < spec.sms * spec.sm_threads)


def column_tile_plans(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec) -> list:
    """The column-tile plans of `rule`'s rows (see `offered`), each with its resources; [] where none fits."""
    if not offered(rule, spec):
        return []
    moved = func if func.attrs is not None and ROW_AXES_ATTR in func.attrs else rows_first(func, rule.row_axes)
    try:
        analysis, rows = _analysed(moved, rule.rank)
    except PlanError:
        return []
    if not rows.columns or rows.rows is None or rows.within_max is None or rows.spatial_only:
        return []
    out = []
    for tile in _tiles(rows.rows, analysis, spec):
        for threads in ROW_THREADS:
            if (rows.within_max % threads or rows.within_max < threads * MIN_PER_THREAD
                    or tile * threads > spec.max_threads_per_block):
                continue
            plan = _plan(analysis, rows, tile, threads, spec, rule)
            if plan is not None:
                out.append(plan)
    return out


def _tiles(rows: int, analysis, spec: TargetSpec) -> list:
    dtype_bytes = widest_bytes(list(analysis.kept))
    sector = max(1, SECTOR_BYTES // dtype_bytes)
    return [sector * k for k in TILE_SECTORS if rows % (sector * k) == 0 and sector * k <= spec.warp_size]


def _analysed(moved: tirx.PrimFunc, rank: int) -> tuple:
    """(analysis, rows) at `rank` row axes, the values per row that are not reductions (a mean's divide)
    recomputed in their consumers: kept once in shared memory, one thread would store one and the others
    read it with no barrier between (TVM's ThreadSync compares the indices, which name the column, not the
    thread along it), and kept in a thread's registers, TVM stores it over the all-reduce's shared result,
    which the other threads of the column read: races, found by Oclgrind."""
    analysis = analyse(moved, "cuda", cuda_rows.LEVELS)
    rows = choose_rows(analysis, rank, None, use_bounds=False)
    inter, _, _ = intermediates(analysis, rows.rank, False, {})
    views = {v.name: v for v in analysis.views}
    per_row = tuple(i.name for i in inter if i.level == SHARED and not views[i.name].has_reduction
                    and i.bytes_per_row <= max(1, views[i.name].writes[0].buffer.dtype.bits // 8))
    if not per_row:
        return analysis, rows
    analysis = analyse(moved, "cuda", cuda_rows.LEVELS, per_row)
    return analysis, choose_rows(analysis, rank, None, use_bounds=False)


def _in_every_thread(inter: Intermediate, reduced: set) -> Intermediate:
    """A reduction's result kept on chip: TVM's all-reduce over threadIdx.y leaves it in every thread of
    the column (see _analysed)."""
    if inter.level != SHARED or inter.name not in reduced:
        return inter
    return dataclasses.replace(inter, level=REGISTER, why=f"{inter.why}; reduced over threadIdx.y: the all-reduce "
                                                          "leaves it in every thread of its column")


def _plan(analysis, rows, tile: int, threads: int, spec: TargetSpec, rule: StitchPlan) -> StitchPlan | None:
    """The plan of `tile` rows per block, `threads` along each; None where its shared memory does not fit."""
    inter, _, symbolic = intermediates(analysis, rows.rank, False, {})
    if symbolic:
        return None
    reduced = {v.name for v in analysis.views if v.has_reduction}
    inter = [_in_every_thread(i, reduced) for i in inter]
    shared_rows = [i.bytes_per_row for i in inter if i.level == SHARED]
    reductions = cuda_rows.reductions_of(list(analysis.kept), rows)
    limit = spec.shared_bytes_per_block

    def shared_at(buffers: list) -> int:
        # TVM's all-reduce over threadIdx.y stages every thread's value (a tree in shared memory).
        staged = sum(nbytes * threads * tile for nbytes, outputs in reductions if outputs < threads)
        return cuda_shared_bytes(buffers, (), threads, tile, spec.warp_size) + staged

    cached, shared_rows = cuda_rows.inputs_on_chip(analysis, rows, False, shared_rows,
                                                  lambda buffers: shared_at(buffers) <= limit)
    shared = shared_at(shared_rows)
    if shared > limit:
        return None
    mapping = ThreadMapping(rows.rows, tile, threads, 1, rows.rows // tile, across=True,
                            row_elements=rows.within_max)
    note = (f"column tiles: {tile} rows (columns) per block across threadIdx.x, {threads} threads along each "
            f"row (threadIdx.y) combined in shared memory, {rows.rows // tile} blocks of {tile * threads} threads"
            + (f"; {', '.join(cached)} kept on chip per row (read from device memory once)" if cached else ""))
    record = CudaRowMapping(mapping, shared, tuple(cached), tuple(shared_rows), reductions, (note,))
    plan = assemble(analysis, rows, inter, spec, rule.kernel, record)
    return with_resources(dataclasses.replace(plan, row_axes=rule.row_axes, notes=plan.notes + rule.notes[-1:]))
