"""The CUDA row-resident plan: one thread block per row (or rows), a row's intermediates in shared memory.

A row of symbolic length with an upper bound (analysis/size_bounds) is
planned as a static row of the bound, if some row-sized part of it stays on
chip; otherwise, or without a bound, it streams (recomputed in every pass).
When a row's shared buffers do not fit a block, SharedMemoryError names the
intermediates that could be recomputed instead (planning/cuda/demotion.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tvm import tirx

from tvm_stitch.analysis.row_alignment import ALIGNED, access_kind
from tvm_stitch.analysis.tir_view import buffer_params, static_product
from tvm_stitch.planning.common import PlanError, block_threads, wanted_blocks
from tvm_stitch.planning.cuda.launch import row_threads, rows_per_block, vector_mapping, widest_bytes
from tvm_stitch.planning.cuda.fill import few_wide_rows, filling_row_threads
from tvm_stitch.planning.plan import SHARED, StitchPlan, ThreadMapping
from tvm_stitch.planning.resources import cuda_shared_bytes
from tvm_stitch.planning.row_resident import (Analysis, LevelRules, Rows, analyse, assemble, check_analysis,
                                              choose_rows, intermediates, row_bytes, row_elements,
                                              static_within_rank)
from tvm_stitch.planning.spec import TargetSpec

LEVELS = LevelRules(output=(SHARED, "kernel output also read inside the kernel"))


class SharedMemoryError(PlanError):
    """The row-resident plan needs more shared memory than a thread block has.

    `demotable`: its shared intermediates that could be recomputed instead, largest first.
    `bounded`: the (size, upper bound) pairs the row was planned for, when its length is symbolic.
    """

    def __init__(self, code: str, demotable: list, bounded: tuple = (), **params):
        super().__init__(code, **params)
        self.demotable = demotable
        self.bounded = bounded


@dataclass(frozen=True)
class CudaRowMapping:
    """How a CUDA row-resident plan maps to the GPU and what each block keeps in shared memory."""

    mapping: ThreadMapping
    shared_bytes: int  # static shared memory per block
    cached_inputs: tuple  # inputs whose row is loaded once into shared memory
    shared_rows: tuple  # bytes per row of each shared buffer
    reductions: tuple  # (value bytes, outputs per row) of each reduced value
    notes: tuple

    def plan_fields(self) -> dict:
        return {"mapping": self.mapping, "shared_bytes": self.shared_bytes, "cached_inputs": self.cached_inputs,
                "shared_rows": self.shared_rows, "shared_reductions": self.reductions}


def choose_rank(kept: list, depth: int, spatial_only: bool, spec: TargetSpec) -> int:
    """Element-wise only: every aligned axis (a thread per element, no barriers). Otherwise the
    fewest leading axes that give enough blocks (at most the aligned depth): whole rows inside a
    block, spread over its threads."""
    if spatial_only and depth:
        return depth
    for rank in range(static_within_rank(kept, depth), depth + 1):
        rows = static_product(kept[0].extents[:rank])
        if rows is None or rows >= wanted_blocks(spec):
            return rank
    return depth


def plan(func: tirx.PrimFunc, spec: TargetSpec, name: str, recompute: tuple = (), rank: int | None = None,
         analysis: Analysis | None = None) -> StitchPlan:
    """The CUDA row-resident plan (see planner.plan_row_resident); SharedMemoryError when a row
    does not fit a block."""
    if analysis is None:
        analysis = analyse(func, spec.family, LEVELS, tuple(recompute))
    else:
        check_analysis(analysis, func, spec.family, recompute)
    rows = choose_rows(analysis, rank, lambda kept, depth, spatial: choose_rank(kept, depth, spatial, spec),
                       use_bounds=True, streams_symbolic=True)
    if rows.spatial_only and not rows.columns and few_wide_rows(rows.rows, rows.within_max, spec):
        try:  # rows spread over threads; where their shared values do not fit, a thread per row
            return _planned(analysis, rows, False, spec, name)
        except SharedMemoryError:
            pass
    return _planned(analysis, rows, rows.spatial_only or rows.columns, spec, name)


def _planned(analysis: Analysis, rows: Rows, thread_per_row: bool, spec: TargetSpec, name: str) -> StitchPlan:
    if thread_per_row and rows.bounded:
        # A row in one thread keeps nothing shared: sized for the bound it would only grow.
        rows = dataclasses.replace(rows, within_max=None, bounds={}, bounded=())
    inter, shared_rows, symbolic_shared = intermediates(analysis, rows.rank, thread_per_row, rows.bounds)
    record = mapping(analysis, rows, inter, shared_rows, symbolic_shared, thread_per_row, spec)
    return assemble(analysis, rows, inter, spec, name, record)


def _threads(rows: Rows, thread_per_row: bool, spec: TargetSpec) -> tuple:
    """(threads per row, notes)."""
    notes = []
    if thread_per_row:
        # Consecutive rows are consecutive in memory: a thread per row keeps loads coalesced.
        threads = 1
        notes.append("element-wise: one thread per element" if rows.spatial_only else
                     "strided rows (column access): one thread per row, rows across threads")
    elif rows.within_max is None:
        threads = block_threads(spec)
        notes.append(f"symbolic row length (no upper bound a row fits in): {threads} threads per row for any length, "
                     "per-row intermediates recomputed (streamed), not kept in shared memory")
    else:
        threads = filling_row_threads(rows.rows, rows.within_max, row_threads(rows.within_max, spec), spec)
    if rows.bounded:
        sizes = ", ".join(f"{name} <= {upper}" for name, upper in rows.bounded)
        notes.append(f"symbolic row length planned for its bound ({sizes}): as a static row of "
                     f"{rows.within_max} elements ({threads} threads, rows kept on chip sized for the bound), "
                     "loops to the bound under a guard (valid for every length within it; no vector accesses)")
    return threads, notes


def _vector(kept: list, rows: Rows, threads: int, thread_per_row: bool, spec: TargetSpec) -> tuple:
    """(vector lanes, threads, notes): vector accesses where element-wise loops span a static row."""
    if (rows.within_max is None or rows.bounded or thread_per_row
            or not any(not v.has_reduction and static_product(v.extents[rows.rank:]) > 1 for v in kept)):
        return 1, threads, []
    vector, threads = vector_mapping(kept, rows.within_max, threads, spec)
    if vector == 1:
        return vector, threads, []
    return vector, threads, [f"{vector * widest_bytes(kept) * 8}-bit accesses: {vector} elements per thread "
                             "in element-wise loops"]


def reductions_of(kept: list, rows: Rows) -> tuple:
    """Each reduced value: (bytes, outputs per row); with fewer outputs than threads, threads share it."""
    rank = rows.rank
    return tuple(
        (max(1, w.buffer.dtype.bits // 8),
         row_elements((e for e, r in zip(v.extents[rank:], v.is_reduce[rank:]) if not r), rows.bounds) or 0)
        for v in kept if v.has_reduction for w in v.writes)


def _cacheable_inputs(views: list, params: list, rank: int) -> list:
    """Inputs (read-only parameters) that several blocks load, each access row-aligned."""
    inputs = [p for p in params if not any(w.buffer.same_as(p) for v in views for w in v.writes)]
    out = []
    for buffer in inputs:
        readers, aligned = [], True
        for view in views:
            accesses = [r for r in view.reads if r.buffer.same_as(buffer)]
            if not accesses:
                continue
            readers.append(view.name)
            aligned &= len(buffer.shape) > rank and all(
                access_kind(r, view.iter_vars[:rank]) == ALIGNED for r in accesses)
        if aligned and len(readers) >= 2:
            out.append(buffer)
    return out


def inputs_on_chip(analysis: Analysis, rows: Rows, thread_per_row: bool, shared_rows: list, fits) -> tuple:
    """(inputs whose row is loaded once into shared memory, bytes per row of every shared buffer):
    each cacheable input whose row still `fits(shared rows)` with those kept so far."""
    cached, shared_rows = [], list(shared_rows)
    for buffer in _cacheable_inputs(list(analysis.kept), buffer_params(analysis.func), rows.rank):
        nbytes = row_bytes(buffer, rows.rank, rows.bounds)
        if thread_per_row:
            cached.append(buffer.name)
        elif nbytes is not None and fits(shared_rows + [nbytes]):
            cached.append(buffer.name)
            shared_rows.append(nbytes)
    return cached, shared_rows


def _check_fits(analysis: Analysis, rows: Rows, inter: list, symbolic_shared: list, shared: int,
                threads: int, cached_inputs: list, limit: int) -> None:
    """SharedMemoryError when one row's buffers (with TVM's all-reduce staging) exceed `limit`, when a
    shared buffer would have a symbolic size (the demotion then recomputes it), or when a row planned
    for its bound keeps nothing row-sized on chip."""
    if shared > limit or symbolic_shared:
        view_of = {v.name: v for v in analysis.views}
        demotable = sorted((i for i in inter if i.level == SHARED and i.name not in analysis.outputs
                            and not view_of[i.name].has_reduction and len(view_of[i.name].writes) == 1
                            and (not symbolic_shared or i.name in symbolic_shared)),
                           key=lambda i: -i.bytes_per_row)
        names = [i.name for i in demotable]
        if symbolic_shared:
            ends = analysis.depth_limit and rows.rank == analysis.depth
            raise SharedMemoryError("symbolic-shared-buffer", names, rows.bounded, blocks=tuple(symbolic_shared),
                                    rank=rows.rank, limit=analysis.depth_limit if ends else "")
        raise SharedMemoryError("shared-memory-exceeded", names, rows.bounded, bytes=shared, limit=limit)
    if rows.bounded and rows.within_max > threads and not cached_inputs and not any(
            i.level == SHARED and i.bytes_per_row >= rows.within_max for i in inter):
        # Each thread would loop to the bound, a short row idling through it, for nothing kept on chip.
        raise SharedMemoryError("bound-keeps-nothing", [], rows.bounded, elements=rows.within_max)


def mapping(analysis: Analysis, rows: Rows, inter: list, shared_rows: list, symbolic_shared: list,
            thread_per_row: bool, spec: TargetSpec) -> CudaRowMapping:
    """The mapping of a CUDA row-resident plan: threads per row, vector lanes, inputs cached on chip,
    rows per block; SharedMemoryError when a row does not fit (see _check_fits)."""
    kept, limit = list(analysis.kept), spec.shared_bytes_per_block
    threads, notes = _threads(rows, thread_per_row, spec)
    vector, threads, vector_notes = _vector(kept, rows, threads, thread_per_row, spec)
    notes += vector_notes
    reductions = reductions_of(kept, rows)

    def shared_at(per_block: int, buffers: list) -> int:
        return cuda_shared_bytes(buffers, reductions, threads, per_block, spec.warp_size)

    cached_inputs, shared_rows = inputs_on_chip(analysis, rows, thread_per_row, shared_rows,
                                                lambda buffers: shared_at(1, buffers) <= limit)
    _check_fits(analysis, rows, inter, symbolic_shared, shared_at(1, shared_rows), threads, cached_inputs, limit)
    per_block = rows_per_block(rows.rows, threads, lambda n: shared_at(n, shared_rows), rows.spatial_only, spec)
    if rows.rows is None and threads > 1:
        notes.append("symbolic row count: one row per block, grid from the runtime extent "
                     "(valid for every size; short rows are not packed, few long rows not split)")
    if per_block > 1 and threads > 1:
        notes.append(f"short rows: {per_block} rows packed per block of {threads * per_block} threads")
    grid = rows.rows // per_block if rows.rows is not None else -1
    threads_of = ThreadMapping(rows.rows if rows.rows is not None else -1, per_block, threads, vector, grid,
                               row_elements=rows.within_max if rows.within_max is not None else -1)
    return CudaRowMapping(threads_of, shared_at(per_block, shared_rows), tuple(cached_inputs), tuple(shared_rows),
                          reductions, tuple(notes))
