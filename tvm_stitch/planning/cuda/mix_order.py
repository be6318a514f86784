"""Rules for the mix-order scheme (CUDA): row reductions and column reductions of the same rows.

A norm backward (LayerNorm, RMSNorm) reduces the same (rows, columns) values
two ways: along each row (dx's sums) and along the rows per column (dgamma,
dbeta). As two groups they are a row-resident kernel and a column-split one,
each reading x and dy. Mix-order reads them once:

- kernel 0: `grid` blocks of `threads` threads (`rows_per_task` 1: a block's
  threads share each row), each owning `rows / grid` consecutive rows; per row the block's threads reduce the row together and
  write its element-wise outputs (as row-resident does), and every thread adds
  the row's values of its columns (`vector` lanes per step) to its registers;
  at the end of its rows a block writes its column partials (grid x columns);
- the partials summed per column (a small read: grid x columns): by a second
  launch (kernel 1), or by the last `combining_blocks` blocks of kernel 0
  behind the arrival counters (schedules/cuda/combine_in_launch: one launch).

The rows per block, kernel 0's thread shape and the combine (a second launch or
k combining blocks) are chosen by the time model (pricing/modeled_time.plan_us
of each candidate, the cheapest kept), so the partials' traffic and the
geometry of both kernels are priced as scheduled. Anything else raises
MixOrderError (a PlanError): element-wise producers that are not outputs are
inlined; every remaining block is a row reduction, an element-wise block over
(rows, columns) or a column reduction of them; static extents; columns that
a warp-multiple of threads times the vector divides.
"""

from __future__ import annotations

import dataclasses
import itertools

import tvm
from tvm import tirx

from tvm_stitch.analysis.tir_view import buffer_params, static_int
from tvm_stitch.planning.common import Analyses, PlanError, inline_trial
from tvm_stitch.planning.common import views as views_of
from tvm_stitch.planning.plan import REGISTER, Intermediate, StitchPlan, ThreadMapping
from tvm_stitch.planning.resources import with_resources
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.modeled_time import plan_us
from tvm_stitch.planning.cuda.arrival_limits import max_combining_blocks
from tvm_stitch.planning.cuda.combine_tiles import combine_tiles

MAX_THREADS = 256  # kernel 0's threads per block where a thread keeps at most MAX_VALUES columns
# Columns a thread keeps (x, dy and a partial per column reduction, each): more take more threads.
# Measured (nvcc 13, ptxas -v): bfloat16 LayerNorm backward 1024x4096, 256 threads of 16 columns, spilled
# 4 bytes on sm_80 (64 registers); 512 threads of 8, none (51). float16 512x8192: 512 threads of 16
# spilled 8 bytes on sm_80.
MAX_VALUES = 8
ROWS_PER_BLOCK = (1, 2, 4, 8, 16, 32)  # candidates of rows per block, priced by the time model


class MixOrderError(PlanError):
    """The group is not row and column reductions of the same rows (with element-wise blocks)."""


def _kinds(view) -> tuple:
    """(static extents, reduce flags) of a block; MixOrderError for symbolic extents."""
    extents = tuple(static_int(e) for e in view.extents)
    if None in extents:
        raise MixOrderError("mix-symbolic", block=view.name)
    return extents, tuple(view.is_reduce)


def _classify(views: list) -> tuple:
    """(rows, columns, column reductions) of the blocks left after inlining: column reductions, their
    element-wise epilogues over the columns (a half-precision sum's cast), and blocks over the rows
    (row reductions, element-wise blocks of (rows, columns)), at least one row reduction among them."""
    columns_of = [v.name for v in views if _kinds(v)[1] == (False, True) and len(v.writes) == 1]
    if not columns_of:
        raise MixOrderError("mix-not-two-orders")
    columns, rows = _kinds(next(v for v in views if v.name == columns_of[0]))[0]
    row_reductions = 0
    for view in views:
        extents, reduce = _kinds(view)
        if view.name in columns_of:
            if extents != (columns, rows):
                raise MixOrderError("mix-block-shape", block=view.name)
            continue
        if extents == (columns,) and not reduce[0]:
            continue  # an element-wise epilogue of the column reductions, in the combining thread
        middle = all(e == 1 and not r for e, r in zip(extents[1:-1], reduce[1:-1]))
        if len(extents) < 2 or extents[0] != rows or reduce[0] or extents[-1] != columns or not middle:
            raise MixOrderError("mix-block-shape", block=view.name)
        row_reductions += reduce[-1]
    if not row_reductions:
        raise MixOrderError("mix-not-two-orders")
    return rows, columns, tuple(columns_of)


def _threads(columns: int, dtype_bytes: int, spec: TargetSpec) -> tuple:
    """(threads, vector): the widest vector whose lanes divide the columns with a warp multiple of
    threads, then the most threads up to MAX_THREADS, or more (up to the target's per block) while a
    thread would keep more than MAX_VALUES columns (its x, dy and partial lanes)."""
    vector = max(1, spec.vector_bytes // dtype_bytes)
    while vector >= 1:
        if columns % vector == 0:
            fits = [t for t in range(spec.warp_size, spec.max_threads_per_block + 1, spec.warp_size)
                    if (columns // vector) % t == 0]
            if fits:
                few = [t for t in fits if t <= MAX_THREADS]
                threads = max(few) if few else min(fits)
                wider = [t for t in fits if t > threads and columns // t <= MAX_VALUES]
                if columns // threads > MAX_VALUES:
                    threads = min(wider) if wider else max(fits)
                return threads, vector
        vector //= 2
    raise MixOrderError("mix-columns-indivisible", columns=columns, vector=spec.vector_bytes // dtype_bytes)


def _row_bytes(params: list, rows: int, columns: int) -> int:
    """Bytes of an element of the widest (rows, columns) parameter (x, dy, dx): the accesses the
    vector lanes widen (a half-precision sum's float32 accumulators stay in registers)."""
    return max(tvm.DataType(p.dtype).bits // 8 for p in params
               if tuple(static_int(e) for e in p.shape) == (rows, columns))


def _inlined(views: list, func: tirx.PrimFunc) -> list:
    """Element-wise blocks that write no parameter: recomputed in their readers."""
    params = buffer_params(func)
    return [v.name for v in views if not v.has_reduction
            and not any(w.buffer.same_as(p) for w in v.writes for p in params)]


def plan_mix_order(func: tirx.PrimFunc, spec: TargetSpec, name: str, analyses: Analyses | None = None) -> StitchPlan:
    """The mix-order plan of a fused PrimFunc, its rows per block the cheapest the time model prices;
    MixOrderError where the group is not this scheme's."""
    if spec.family != "cuda":
        raise MixOrderError("mix-not-two-orders")
    views = views_of(func, analyses)
    inlined = _inlined(views, func)
    _, kept = inline_trial(func, inlined, MixOrderError, analyses)
    rows, columns, column_reductions = _classify(kept)
    params = buffer_params(func)
    threads, vector = _threads(columns, _row_bytes(params, rows, columns), spec)
    outputs = tuple(v.name for v in kept if any(w.buffer.same_as(p) for w in v.writes for p in params))
    base = StitchPlan(
        kernel=name, target="cuda", scheme="mix-order", ops=tuple(v.name for v in views),
        dominant=column_reductions, rank=1, row_shape=(str(rows),),
        mapping=ThreadMapping(rows=rows, rows_per_task=1, threads=threads, vector=vector, grid=rows, split=rows,
                              row_elements=columns),
        intermediates=tuple(Intermediate(n, REGISTER, 0, "element-wise: recomputed in each reader", inlined=True)
                            for n in inlined),
        outputs=outputs, reductions=sum(v.has_reduction for v in kept), kernels=2, spec=spec)
    return _cheapest(func, base, rows, spec)


def _cheapest(func: tirx.PrimFunc, base: StitchPlan, rows: int, spec: TargetSpec) -> StitchPlan:
    """The candidate rows per block (whole chunks, at least an SM's worth of blocks), each with its
    partials combined by a second launch or by the last blocks of the first (combining_candidates),
    the time model prices cheapest, with a note of the choice."""
    priced, two = [], {}
    for per_block, (threads, vector) in itertools.product(ROWS_PER_BLOCK, _thread_shapes(base.mapping, spec)):
        grid = rows // per_block
        if rows % per_block or grid < spec.sms:
            continue
        plan = with_resources(dataclasses.replace(base, mapping=dataclasses.replace(
            base.mapping, grid=grid, split=grid, threads=threads, vector=vector)))
        us = plan_us(func, plan, spec)
        if us >= 0:
            priced.append((us, per_block, plan))
            two[per_block] = us
        priced += [(us, per_block, one) for us, one in _one_launch(func, plan, spec)]
    if not priced:
        if rows // ROWS_PER_BLOCK[0] < spec.sms:
            raise MixOrderError("mix-no-chunks", rows=rows, sms=spec.sms)
        raise MixOrderError("mix-not-priced")
    us, per_block, plan = min(priced, key=lambda p: p[0])
    m = plan.mapping
    combine = (f"summed by the last {m.combining_blocks} of them in the same launch (arrival counters)"
               if m.combining_blocks else "summed by a second launch")
    best_two = min(two.values(), default=-1.0)
    note = (f"mix-order: {m.grid} blocks of {m.threads} threads, {per_block} rows per block, "
            f"{m.vector}-element column steps; column partials ({m.grid} x {len(plan.dominant)} reductions) "
            f"{combine}; {us:.1f} us, cheapest of {len(priced)} candidates (row chunkings x combines; "
            f"the cheapest with a second launch {best_two:.1f} us)")
    return dataclasses.replace(plan, modeled_us=us, notes=(note,))


def _thread_shapes(mapping: ThreadMapping, spec: TargetSpec) -> list:
    """(threads, vector) of kernel 0: the widest vector's (_threads), and where twice its threads are at
    most MAX_THREADS, twice the threads at half the vector (more threads to combine the partials in the
    same launch, more loads in flight)."""
    shapes = [(mapping.threads, mapping.vector)]
    if mapping.vector > 1 and 2 * mapping.threads <= MAX_THREADS:
        shapes.append((2 * mapping.threads, mapping.vector // 2))
    return shapes


def combining_candidates(plan: StitchPlan, spec: TargetSpec) -> list:
    """Counts of combining blocks for a one-launch combine: those that divide the column tiles, at most
    the blocks that may wait (arrival_limits.max_combining_blocks) and the grid, the largest and the powers of
    two above a quarter of it; none where no combine tile fits (combine_tiles.combine_tiles)."""
    tiles = combine_tiles(plan)
    fits = [k for k in range(1, min(tiles, max_combining_blocks(spec), plan.mapping.grid) + 1) if tiles % k == 0]
    return sorted({k for k in fits if k & (k - 1) == 0 and 4 * k >= fits[-1]} | set(fits[-1:]))


def _one_launch(func: tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> list:
    """(modeled us, plan) of each one-launch form of `plan` the time model prices, cheapest first."""
    priced = []
    for k in combining_candidates(plan, spec):
        candidate = dataclasses.replace(plan, kernels=1, mapping=dataclasses.replace(plan.mapping, combining_blocks=k))
        us = plan_us(func, candidate, spec)
        if us >= 0:
            priced.append((us, candidate))
    return sorted(priced, key=lambda p: p[0])
