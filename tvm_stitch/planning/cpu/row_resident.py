"""The CPU row-resident plan: row tasks in parallel over the cores, each row's loops in vector lanes.

A kernel output is written to memory and read back by the thread that wrote
it; a row's intermediates live in per-row buffers (L1/L2). Rows that are
columns of the inputs are streamed several per task, and few long rows are
cut into chunks over the cores (planning/cpu/tasks.py). Short rows that
reduce go across the vector lanes instead: a lane per row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from tvm_stitch.analysis.tir_view import static_int, static_product
from tvm_stitch.planning.cpu.tasks import reduction_chunks, row_chunks, stream_rows
from tvm_stitch.planning.plan import GLOBAL, MIN_LANES, StitchPlan, ThreadMapping
from tvm_stitch.planning.row_resident import (Analysis, LevelRules, Rows, analyse, assemble, check_analysis,
                                              choose_rows, intermediates, static_within_rank)
from tvm_stitch.planning.spec import TargetSpec

CPU_MIN_ROWS = 64  # row tasks for an even spread over cores
CPU_MIN_TASK = 64  # elements a row task keeps at least (whole vectors), even below CPU_MIN_ROWS rows
CPU_PARALLEL_MIN_WORK = 1 << 15  # elements below which a parallel launch costs more than it saves

# Without native half-precision arithmetic, every float16/bfloat16 op on the CPU
# converts through float32: recomputing it is not cheap.
EMULATED_ON_CPU = ("float16", "bfloat16")

LEVELS = LevelRules(output=(GLOBAL, "kernel output, read back by the same thread"), emulated=EMULATED_ON_CPU)


@dataclass(frozen=True)
class CpuRowMapping:
    """How a CPU row-resident plan maps to the cores and vector lanes."""

    mapping: ThreadMapping
    notes: tuple

    def plan_fields(self) -> dict:
        return {"mapping": self.mapping}


def choose_rank(views: list, depth: int) -> int:
    """The fewest leading axes that still give enough row tasks (at most the aligned depth).

    Fewer row axes keep whole rows inside a task: contiguous inner loops to
    vectorise. A row task keeps at least CPU_MIN_TASK elements: 32 rows
    of 1024 stay 32 vectorised tasks rather than 32768 single elements.
    """
    for rank in range(static_within_rank(views, depth), depth + 1):
        rows = static_product(views[0].extents[:rank])
        deeper_task = static_product(views[0].extents[rank + 1:])
        if (rows is None or rows >= CPU_MIN_ROWS
                or (rank < depth and deeper_task is not None and deeper_task < CPU_MIN_TASK)):
            return _reduction_rank(views, rank, depth)
    return depth


def _reduction_rank(views: list, rank: int, depth: int) -> int:
    """Rows deep enough that each reduction has nothing but its reduced axes inside a row.

    A row then holds one reduction per block, which splits into vector lanes
    (rfactor); with spatial axes left inside the row (attention scores: rows
    of batch x heads, 128 reductions each) every reduction stays scalar.
    """
    for deeper in range(rank, depth + 1):
        if all(static_int(e) == 1 for v in views if v.has_reduction
               for e, r in zip(v.extents[deeper:], v.is_reduce[deeper:]) if not r):
            return deeper
    return rank


def plan(func: tirx.PrimFunc, spec: TargetSpec, name: str, recompute: tuple = (), rank: int | None = None,
         analysis: Analysis | None = None) -> StitchPlan:
    """The CPU row-resident plan (see planner.plan_row_resident)."""
    if analysis is None:
        analysis = analyse(func, spec.family, LEVELS, tuple(recompute))
    else:
        check_analysis(analysis, func, spec.family, recompute)
    rows = choose_rows(analysis, rank, lambda kept, depth, _spatial: choose_rank(kept, depth), use_bounds=False)
    inter, _, _ = intermediates(analysis, rows.rank, False, rows.bounds)
    return assemble(analysis, rows, inter, spec, name, mapping(analysis, rows, spec))


def _cores_and_lanes(views: tuple, spec: TargetSpec) -> tuple:
    """(cores, vector lanes): the cores where the work pays a parallel launch, lanes of the output's dtype."""
    work = max(static_product(v.extents) or CPU_PARALLEL_MIN_WORK for v in views)
    threads = spec.cores if work >= CPU_PARALLEL_MIN_WORK else 1
    out_dtype = views[-1].writes[0].buffer.dtype
    # Half precision computes in float32 on the CPU (precision.py): lanes of float32 at least.
    lanes = spec.vector_bytes * 8 // max(32, out_dtype.bits)
    # Emulated half precision gains nothing from wide vectors: each lane converts alone,
    # unless the CPU converts float16 vectors (x86 F16C).
    emulated = str(out_dtype) in EMULATED_ON_CPU and not (str(out_dtype) == "float16" and spec.converts_half)
    return threads, 1 if emulated else max(1, lanes)


def _streamed(kept: tuple, rows: Rows, threads: int) -> tuple:
    """(rows per task, chunks of the reduction, notes) where rows are columns of the inputs."""
    per_task = stream_rows(rows.rows, threads)
    if per_task == 1:
        return 1, 1, []
    notes = [f"rows are columns of the inputs: {per_task} adjacent rows per task, "
             "streamed down the reduction axis in vector lanes"]
    reduced = max(static_product(e for e, r in zip(v.extents[rows.rank:], v.is_reduce[rows.rank:]) if r) or 1
                  for v in kept)
    split = reduction_chunks(reduced)
    if split > 1:
        notes.append(f"reduction of {reduced} cut into {split} chunks: partials in parallel, then combined")
    return per_task, split, notes


def lanes_across(rows: Rows, lanes: int, split: int, reductions: int) -> bool:
    """Whether the vector lanes go across rows (a lane per row) rather than along each row.

    Across rows every lane works and a reduction is a lane-wise max or sum
    over the row's elements, at the price of regrouping a vector's rows by
    lane shuffles on the way in and out. Along a row of at most a quarter of
    the lanes the vectors run a quarter full: across pays with any reduction.
    Along a row of at most half the lanes they run half full and each
    reduction ends in a horizontal combine per row: across pays with two
    reductions or more (softmax, LayerNorm), not with one (RMSNorm). Rows of
    a static length that a vector of MIN_LANES or more divides: the along
    plan leaves other rows (2, 3, 5, 6 elements) scalar per row, and LLVM
    vectorises that row loop across rows by itself (across: 0.92-1.01x). At
    least a vector of rows (a symbolic count: any, the rows past the last
    whole vector run in the loop's scalar tail), not columns of the inputs
    (streamed already) nor cut into chunks.
    """
    if rows.rank == 0 or rows.columns or split > 1 or rows.within_max is None or reductions == 0:
        return False
    if rows.within_max % MIN_LANES:
        return False
    if rows.rows is not None and rows.rows < lanes:
        return False
    return 4 * rows.within_max <= lanes or (2 * rows.within_max <= lanes and reductions >= 2)


def mapping(analysis: Analysis, rows: Rows, spec: TargetSpec) -> CpuRowMapping:
    """The mapping of a CPU row-resident plan: cores over row tasks, vector lanes, and for
    columns or few long rows the chunks a row is cut into."""
    threads, vector = _cores_and_lanes(analysis.views, spec)
    notes, stream_notes = [], []
    rows_per_task, split = 1, 1
    if rows.columns:
        rows_per_task, split, stream_notes = _streamed(analysis.kept, rows, threads)
    elif rows.rows is not None and rows.within_max is not None and threads > 1:
        split = row_chunks(rows.rows, rows.within_max, threads)
        if split > 1:
            notes.append(f"few long rows: each row cut into {split} chunks over the cores, one parallel "
                         "loop per block, reductions as per-chunk partials then combined; "
                         "intermediates between blocks in memory")
    reductions = sum(1 for v in analysis.views if v.has_reduction)
    across = lanes_across(rows, vector, split, reductions)
    if across:
        notes.append(f"short rows ({rows.within_max} elements, {reductions} reductions, {vector} lanes): rows "
                     "across the vector lanes, a lane per row, each row's loops unrolled (LLVM vectorises the "
                     "row loop: contiguous loads regrouped by lane shuffles)")
    grid = rows.rows // rows_per_task if rows.rows is not None else -1
    if rows.rows is None:
        notes.append("symbolic row count: row tasks in parallel over the runtime rows "
                     "(valid for every size; few long rows are not cut into chunks)")
    mapping_of = ThreadMapping(rows.rows if rows.rows is not None else -1, rows_per_task, threads, vector, grid, split,
                               across)
    return CpuRowMapping(mapping_of, tuple(notes + stream_notes))
