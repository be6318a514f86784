"""Rules that turn a fused PrimFunc into a StitchPlan for a target.

The row-resident scheme: the leading aligned axes are rows; one row task
(a CUDA thread block, a CPU loop iteration) computes every block for its
row. Per block the planner chooses where its result lives:
- inlined into consumers (register level) when it is cheap element-wise or
  injective work and not a kernel output;
- on chip (shared memory on CUDA, a per-row buffer on CPU) when it is a
  reduction result, holds an expensive op (computed once, never
  recomputed), depends on a gather (reads through computed indices, which
  no aligned row cache serves) and is read more than once per element, or
  is a kernel output that other blocks also read;
- kernel outputs are written to global memory.
A row of symbolic length with an upper bound (analysis/size_bounds) is planned
on CUDA as a static row of the bound, if some row-sized part of it stays on
chip; otherwise, or without a bound, it streams (recomputed in every pass).
Anything the scheme cannot express raises PlanError with the reason; the
caller then leaves the group to TVM's default path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tvm import s_tir, tirx

from tvm_stitch.analysis.row_axes import find_row_axes, rows_first
from tvm_stitch.analysis.row_alignment import ALIGNED, access_kind, analyze_rows, walks_columns
from tvm_stitch.analysis.size_bounds import ATTR as SIZE_BOUNDS, size_bounds, upper_bound
from tvm_stitch.analysis.tir_view import (GATHER, block_consumers, block_views, buffer_params,
                                          static_int, static_product, vars_in)
from tvm_stitch.planning.column_split import ColumnError, plan_column_split
from tvm_stitch.planning.fill import filling_row_threads
from tvm_stitch.planning.common import (PlanError, block_threads, check_describable, inline_trial, output_blocks,
                                        wanted_blocks)
from tvm_stitch.planning.plan import GLOBAL, REGISTER, SHARED, Intermediate, StitchPlan, ThreadMapping
from tvm_stitch.planning.resources import cuda_shared_bytes, with_resources
from tvm_stitch.planning.row_split import SplitError, plan_row_split
from tvm_stitch.planning.spec import TargetSpec

CUDA_MIN_THREADS = 8  # below a quarter warp, packing more rows beats more threads per row
CPU_MIN_ROWS = 64  # row tasks for an even spread over cores
CPU_MIN_TASK = 64  # elements a row task keeps at least (whole vectors), even below CPU_MIN_ROWS rows
CPU_PARALLEL_MIN_WORK = 1 << 15  # elements below which a parallel launch costs more than it saves
CPU_STREAM_MIN_ROWS = 16  # adjacent rows streamed together when rows are columns: a 64-byte line of float32
CPU_STREAM_MAX_ROWS = 256  # at most 1 KB of float32 per step: a few cache lines, prefetched
CPU_TASKS_PER_CORE = 4  # streamed tasks per core, for an even spread
CPU_SPLIT_CHUNK = 4096  # longest reduction a streamed task sums in one go (accuracy; the rest: partials)
CPU_SPLIT_MIN_ROW = 1 << 15  # rows at least this long are cut into chunks when there are too few for the cores
CPU_SPLIT_MIN_CHUNK = 4096  # elements per chunk at least: a chunk's parallel task outweighs its launch share
LARGE_WORK = 1 << 20  # elements above which a kernel must have a row axis to spread over


# Without native half-precision arithmetic, every float16/bfloat16 op on the CPU
# converts through float32: recomputing it is not cheap.
EMULATED_ON_CPU = ("float16", "bfloat16")


INLINE = "inlined"  # planner-internal: register level, recomputed in each consumer


class SharedMemoryError(PlanError):
    """The row-resident plan needs more shared memory than a thread block has.

    `demotable`: its shared intermediates that could be recomputed instead, largest first.
    `bounded`: the (size, upper bound) pairs the row was planned for, when its length is symbolic.
    """

    def __init__(self, message: str, demotable: list, bounded: tuple = ()):
        super().__init__(message)
        self.demotable = demotable
        self.bounded = bounded


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _level(view, consumers: list, levels: dict, evaluations: dict, is_output: bool,
           family: str, gathered: bool) -> tuple:
    """Where a block's result lives, given the levels already chosen for its consumers.

    `evaluations[c]` is how often consumer c is evaluated per element of its
    own result when inlined; an expensive or `gathered` block (one whose value
    depends on a read through computed indices) is inlined only if that makes
    it evaluated once per element.
    """
    if is_output:
        if family == "cuda":
            return SHARED, "kernel output also read inside the kernel"
        return GLOBAL, "kernel output, read back by the same thread"
    if view.has_reduction:
        return SHARED, "reduction result broadcast over its row"
    if len(view.writes) != 1:
        return SHARED, "block writes several buffers"
    emulated = family == "cpu" and str(view.writes[0].buffer.dtype) in EMULATED_ON_CPU
    if not view.expensive and not emulated and not gathered:
        return INLINE, "cheap: recomputed in each consumer"
    if _evaluations(view, consumers, levels, evaluations) == 1:
        what = ", ".join(view.expensive) or "a gathered value"
        return INLINE, f"{what} evaluated once, inlined into its consumer"
    if gathered and not view.expensive and not emulated:
        return SHARED, "gathered once: reads through computed indices, kept for its several uses"
    if emulated:
        return SHARED, f"computed once: {view.writes[0].buffer.dtype} arithmetic is emulated on the CPU"
    return SHARED, f"computed once: {', '.join(view.expensive)}"


def _evaluations(view, consumers: list, levels: dict, evaluations: dict) -> int:
    buffer = view.writes[0].buffer
    return sum(
        c.loads_of(buffer) * (evaluations.get(c.name, 1) if levels.get(c.name, (GLOBAL,))[0] == INLINE else 1)
        for c in consumers
    )


def _row_elements(extents, bounds: dict) -> int | None:
    """Elements of a row of `extents`: their product, or its upper bound over the sizes' `bounds`
    (None when a size is unbounded)."""
    extents = list(extents)
    static = static_product(extents)
    if static is not None or not bounds:
        return static
    total = extents[0]
    for extent in extents[1:]:
        total = total * extent
    return upper_bound(total, bounds)


def _row_bytes(buffer, rank: int, bounds: dict) -> int | None:
    per_row = _row_elements(buffer.shape[rank:], bounds)
    return None if per_row is None else per_row * max(1, buffer.dtype.bits // 8)


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


def _rows_per_block(rows: int | None, threads: int, shared_at, spatial_only: bool, spec: TargetSpec) -> int:
    """Rows packed into one thread block: up to `block_threads` threads, dividing the rows
    evenly (no thread predicate around a barrier), within shared memory (`shared_at(rows per
    block)`: bytes), leaving a block per SM."""
    per = 1
    most = block_threads(spec)
    if threads == 1:
        # One thread per row, no barriers, so a predicate may cover a partial last block
        # (also of a symbolic row count). Element-wise: full blocks. Serial per-row work
        # (columns): a warp of rows per block, so that few columns still make several blocks.
        cap = most if spatial_only else spec.warp_size
        while per < cap and (rows is None or per < rows):
            per *= 2
        return per
    if rows is None:
        return 1  # rows x threads with barriers: only whole blocks, which a symbolic count cannot promise
    while (
        threads * per * 2 <= most
        and rows % (per * 2) == 0
        and rows // (per * 2) >= wanted_blocks(spec) // 2
        and shared_at(per * 2) <= spec.shared_bytes_per_block
    ):
        per *= 2
    return per


def _cpu_row_chunks(rows: int, row_length: int, threads: int) -> int:
    """Chunks per row for few long rows on the CPU (1: rows alone spread over the cores).

    With fewer rows than CPU_TASKS_PER_CORE per core and rows of at least
    CPU_SPLIT_MIN_ROW elements: the smallest power of two that gives every core
    CPU_TASKS_PER_CORE chunks, dividing the row, chunks of CPU_SPLIT_MIN_CHUNK
    elements or more.
    """
    if rows >= threads * CPU_TASKS_PER_CORE or row_length < CPU_SPLIT_MIN_ROW:
        return 1
    split = 1
    while (rows * split < threads * CPU_TASKS_PER_CORE and row_length % (split * 2) == 0
           and row_length // (split * 2) >= CPU_SPLIT_MIN_CHUNK):
        split *= 2
    return split


def _cpu_stream_rows(rows: int | None, threads: int) -> int:
    """Adjacent rows per CPU task when rows are columns of the inputs (1: no streaming).

    A power of two from CPU_STREAM_MIN_ROWS up to CPU_STREAM_MAX_ROWS that
    divides the rows (no partial task, so the row loop vectorises) and leaves
    CPU_TASKS_PER_CORE tasks per core where the rows allow.
    """
    if rows is None or rows % CPU_STREAM_MIN_ROWS:
        return 1
    per = CPU_STREAM_MIN_ROWS
    while (per * 2 <= CPU_STREAM_MAX_ROWS and rows % (per * 2) == 0
           and rows // (per * 2) >= threads * CPU_TASKS_PER_CORE):
        per *= 2
    return per


def _widest_bytes(views: list) -> int:
    return max(max(8, a.buffer.dtype.bits) for v in views for a in v.reads + v.writes) // 8


def _vector_mapping(views: list, row_length: int, threads: int, spec: TargetSpec) -> tuple:
    """(vector lanes, threads) for the widest accesses: each thread takes `lanes` consecutive
    elements of a row, so a row of `row_length` needs a multiple of a warp of threads x lanes."""
    warp = spec.warp_size
    lanes = spec.vector_bytes // _widest_bytes(views)
    while lanes > 1:
        per_row = row_length // lanes
        if row_length % lanes == 0 and per_row % warp == 0:
            count = min(block_threads(spec), per_row)
            while per_row % count:
                count -= warp
            return lanes, count
        lanes //= 2
    return 1, threads


def _choose_rank(views: list, depth: int, spec: TargetSpec) -> int:
    """The fewest leading axes that still give enough row tasks (at most the aligned depth).

    Fewer row axes keep whole rows inside a task: contiguous inner loops to
    vectorise (CPU) or to spread over a block's threads (CUDA). On the CPU a
    row task keeps at least CPU_MIN_TASK elements: 32 rows
    of 1024 stay 32 vectorised tasks rather than 32768 single elements.
    """
    cuda = spec.family == "cuda"
    wanted = wanted_blocks(spec) if cuda else CPU_MIN_ROWS
    for rank in range(_static_within_rank(views, depth), depth + 1):
        rows = static_product(views[0].extents[:rank])
        deeper_task = static_product(views[0].extents[rank + 1:])
        if (rows is None or rows >= wanted
                or (not cuda and rank < depth and deeper_task is not None and deeper_task < CPU_MIN_TASK)):
            return rank if cuda else _cpu_reduction_rank(views, rank, depth)
    return depth


def _static_within_rank(views: list, depth: int) -> int:
    """The fewest leading axes (at least 1) outside which no block has a symbolic extent.

    Symbolic axes (batch, sequence) become rows where the aligned depth allows:
    the grid then follows the runtime extent while each row keeps a static length.
    """
    rank = 1
    for view in views:
        for axis, extent in enumerate(view.extents[:depth]):
            if static_int(extent) is None:
                rank = max(rank, axis + 1)
    return min(rank, max(1, depth))


def _cpu_reduction_rank(views: list, rank: int, depth: int) -> int:
    """On the CPU, rows deep enough that each reduction has nothing but its reduced axes inside a row.

    A row then holds one reduction per block, which splits into vector lanes
    (rfactor); with spatial axes left inside the row (attention scores: rows
    of batch x heads, 128 reductions each) every reduction stays scalar.
    """
    for deeper in range(rank, depth + 1):
        if all(static_int(e) == 1 for v in views if v.has_reduction
               for e, r in zip(v.extents[deeper:], v.is_reduce[deeper:]) if not r):
            return deeper
    return rank


def _levels(views: list, outputs: set, family: str, recompute: tuple = (), gathered: set = frozenset()) -> dict:
    """Level and reason for every block whose result is read inside the kernel, last block first.

    Blocks in `recompute` are inlined although expensive: demoted from shared memory.
    Blocks in `gathered` are kept on chip when read more than once per element.
    """
    consumers = block_consumers(views)
    by_name = {view.name: view for view in views}
    levels, evaluations = {}, {}
    for view in reversed(views):
        if not consumers[view.name]:
            continue
        users = [by_name[c] for c in consumers[view.name]]
        if view.name in recompute:
            levels[view.name] = (INLINE, "demoted from shared memory (the row does not fit): "
                                         "recomputed in each consumer")
        else:
            levels[view.name] = _level(view, users, levels, evaluations, view.name in outputs, family,
                                       view.name in gathered)
        if levels[view.name][0] == INLINE:
            evaluations[view.name] = max(1, _evaluations(view, users, levels, evaluations))
    return levels


def _gathered(views: list) -> set:
    """Names of the blocks whose value depends on a read through computed indices (a `take`,
    a concat), directly or through the blocks they read."""
    out = set()
    for view in views:
        producers = [p for p in views if p.name in out]
        if any(a.kind == GATHER for a in view.reads) or any(
                r.buffer.same_as(w.buffer) for p in producers for w in p.writes for r in view.reads):
            out.add(view.name)
    return out


def _kept_rows(func: tirx.PrimFunc, views: list, levels: dict) -> tuple:
    """(kept blocks, their row alignment) once the register-level blocks are inlined: those decide the rows."""
    trial, kept = inline_trial(func, [v.name for v in views if levels.get(v.name, (GLOBAL,))[0] == INLINE])
    check_describable(kept)
    return kept, analyze_rows(trial.mod["main"], kept)


@dataclass(frozen=True)
class Analysis:
    """The part of a row-resident plan that no rank changes: made once per fused PrimFunc,
    family and demotions, and passed to every plan made from it (candidates re-plan at other ranks)."""

    func: tirx.PrimFunc
    family: str
    recompute: tuple  # blocks demoted from shared memory to recomputation
    views: tuple  # every block
    outputs: frozenset  # blocks that write the kernel's outputs
    levels: dict  # block -> (level, why), for blocks read inside the kernel
    kept: tuple  # the blocks left once the register-level ones are inlined
    depth: int  # aligned row depth of the kept blocks
    depth_limit: str  # why the aligned depth stops there (the row alignment's reason)


def analyse(func: tirx.PrimFunc, family: str, recompute: tuple = ()) -> Analysis:
    """The rank-independent analysis of a fused PrimFunc (PlanError if the scheme cannot hold it)."""
    views = block_views(s_tir.Schedule(func))
    check_describable(views)
    outputs = output_blocks(views, func)
    gathered = _gathered(views)
    levels = _levels(views, outputs, family, recompute, gathered)
    kept, rows = _kept_rows(func, views, levels)
    if any(levels[name][0] != INLINE for name in gathered if name in levels):
        # A gathered result kept on chip may be read across rows, where recomputed it would not be.
        inlined = _levels(views, outputs, family, recompute)
        kept_inlined, rows_inlined = _kept_rows(func, views, inlined)
        if rows_inlined.depth > rows.depth:
            levels, kept, rows = inlined, kept_inlined, rows_inlined
    return Analysis(func, family, tuple(recompute), tuple(views), frozenset(outputs), levels, tuple(kept), rows.depth,
                    rows.limit)


@dataclass(frozen=True)
class _Rows:
    """The row axes chosen for a plan and what they leave inside a row."""

    rank: int
    extents: tuple  # PrimExpr per row axis
    rows: int | None  # row tasks (None: symbolic)
    within_max: int | None  # the most elements a kept block has inside one row (None: a symbolic length)
    spatial_only: bool  # no kept block reduces
    columns: bool  # some block walks an input along a strided axis
    # Symbolic row lengths planned for their upper bound: the sizes' bounds ({name: (lower, upper)})
    # and the (size, upper bound) pairs inside a row; empty for static or unbounded lengths.
    bounds: dict = dataclasses.field(default_factory=dict)
    bounded: tuple = ()


def _rows(analysis: Analysis, rank: int | None, spec: TargetSpec) -> _Rows:
    kept, depth = list(analysis.kept), analysis.depth
    spatial_only = not any(v.has_reduction for v in kept)
    if rank is None:
        # CUDA, element-wise only: a thread per element (all aligned axes are rows), no barriers.
        rank = depth if spec.family == "cuda" and spatial_only and depth else _choose_rank(kept, depth, spec)
    elif not min(1, depth) <= rank <= depth:
        raise PlanError(f"rank {rank} is outside the aligned depth 1..{depth}")
    sizes = [static_product(v.extents) for v in kept]
    # CUDA, a symbolic count in one row task (a loss mean over a symbolic batch): one block streams it,
    # for any count, in one launch, where TVM's path runs it in single-thread kernels.
    streamed = spec.family == "cuda" and None in sizes
    if rank == 0 and not streamed and (None in sizes or max(sizes) >= LARGE_WORK):
        work = "an unbounded number of elements" if None in sizes else f"{max(sizes)} elements"
        raise PlanError(f"no row axis shared by all blocks ({analysis.depth_limit}), and one row task "
                        f"cannot hold {work}")
    within = [static_product(view.extents[rank:]) for view in kept]
    bounds, bounded = {}, ()
    if None in within and spec.family == "cuda":
        # A symbolic row length with an upper bound (softmax over a key length of at most 128):
        # planned as a static row of the bound, loops to the bound under a guard.
        bounds = size_bounds(analysis.func)
        within = [_row_elements(view.extents[rank:], bounds) for view in kept]
        inside = {v.name for view in kept for e in view.extents[rank:] for v in vars_in(e)}
        bounded = tuple(sorted((name, bounds[name][1]) for name in inside if name in bounds))
        if None in within:
            bounds, bounded = {}, ()
    # None: a symbolic row length without an upper bound; planned for any length.
    within_max = None if None in within else max([1] + within)
    row_extents = kept[0].extents[:rank]
    return _Rows(rank, tuple(row_extents), static_product(row_extents), within_max, spatial_only,
                 walks_columns(kept, buffer_params(analysis.func), rank), bounds, bounded)


def _intermediates(analysis: Analysis, rank: int, thread_per_row: bool, bounds: dict) -> tuple:
    """(intermediates, bytes per row of each shared one, shared ones of unbounded symbolic size) for
    the levels chosen, at `rank` row axes; a row of symbolic length within `bounds` takes its bound."""
    kept_by_name = {v.name: v for v in analysis.kept}
    intermediates, shared_rows, symbolic = [], [], []
    for view in analysis.views:
        if view.name not in analysis.levels:
            continue
        level, why = analysis.levels[view.name]
        per_row = 1
        if view.name in kept_by_name:
            kept_view = kept_by_name[view.name]
            per_row = _row_elements((e for e, r in zip(kept_view.extents[rank:], kept_view.is_reduce[rank:]) if not r),
                                    bounds)
        nbytes = (per_row or 1) * max(1, view.writes[0].buffer.dtype.bits // 8)
        if level == SHARED and thread_per_row:
            level, why = REGISTER, f"{why}; one thread per row: kept in that thread"
        if level == SHARED and per_row is None:
            symbolic.append(view.name)
        elif level == SHARED:
            shared_rows.append(nbytes)
        intermediates.append(Intermediate(view.name, REGISTER if level == INLINE else level, nbytes, why,
                                          inlined=level == INLINE))
    return intermediates, shared_rows, symbolic


def plan_row_resident(func: tirx.PrimFunc, spec: TargetSpec, name: str, recompute: tuple = (),
                      rank: int | None = None, analysis: Analysis | None = None) -> StitchPlan:
    """The row-resident plan of a fused PrimFunc: levels first, then rows of what remains.

    `recompute`: blocks demoted from shared memory to recomputation in their consumers.
    `rank` fixes the number of leading axes that form the rows (at most the
    aligned depth); by default the rules choose it. `analysis` (from
    `analyse(func, spec.family, recompute)`) saves redoing it.
    """
    if analysis is None:
        analysis = analyse(func, spec.family, tuple(recompute))
    elif not (analysis.func.same_as(func) and (analysis.family, analysis.recompute) == (spec.family, tuple(recompute))):
        raise ValueError("the analysis passed was made for another function, family or demotion")
    rows = _rows(analysis, rank, spec)
    thread_per_row = spec.family == "cuda" and (rows.spatial_only or rows.columns)
    if thread_per_row and rows.bounded:
        # A row in one thread keeps nothing shared: sized for the bound it would only grow.
        rows = dataclasses.replace(rows, within_max=None, bounds={}, bounded=())
    intermediates, shared_rows, symbolic_shared = _intermediates(analysis, rows.rank, thread_per_row, rows.bounds)
    if spec.family == "cuda":
        mapping, shared, cached_inputs, notes, shared_rows, reductions = _cuda_mapping(
            analysis, rows, intermediates, shared_rows, symbolic_shared, thread_per_row, spec)
    else:
        mapping, notes = _cpu_mapping(analysis, rows, spec)
        shared, cached_inputs, shared_rows, reductions = 0, [], (), ()
    views = analysis.views
    dominant = tuple(v.name for v in views if v.has_reduction) or tuple(
        v.name for v in views if v.expensive
    ) or (views[-1].name,)
    if rows.rank == 0:
        notes.append("no shared row axis: the whole kernel is one row task")
    return StitchPlan(
        kernel=name,
        target=spec.family,
        scheme="row-resident",
        ops=tuple(v.name for v in views),
        dominant=dominant,
        rank=rows.rank,
        row_shape=tuple(str(static_int(e) if static_int(e) is not None else e) for e in rows.extents),
        mapping=mapping,
        intermediates=tuple(intermediates),
        outputs=tuple(v.name for v in views if v.name in analysis.outputs),
        cached_inputs=tuple(cached_inputs),
        shared_bytes=shared,
        shared_rows=tuple(shared_rows),
        shared_reductions=reductions,
        reductions=sum(1 for v in views if v.has_reduction),
        notes=tuple(notes),
        aligned_depth=analysis.depth,
        bounds=rows.bounded,
        spec=spec,
    )


def _cuda_mapping(analysis: Analysis, rows: _Rows, intermediates: list, shared_rows: list, symbolic_shared: list,
                  thread_per_row: bool, spec: TargetSpec) -> tuple:
    """(mapping, shared bytes per block, inputs cached on chip, notes, bytes per row of each shared
    buffer, reduced values) of a CUDA row-resident plan; SharedMemoryError when one row's buffers
    (with TVM's all-reduce staging) do not fit a block's shared memory, or when a shared buffer
    would have a symbolic size (the demotion then recomputes it)."""
    kept, rank = list(analysis.kept), rows.rank
    limit = spec.shared_bytes_per_block
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
        threads = max(CUDA_MIN_THREADS, min(block_threads(spec), _next_pow2(rows.within_max)))
        threads = filling_row_threads(rows.rows, rows.within_max, threads, spec)
    if rows.bounded:
        sizes = ", ".join(f"{name} <= {upper}" for name, upper in rows.bounded)
        notes.append(f"symbolic row length planned for its bound ({sizes}): as a static row of "
                     f"{rows.within_max} elements ({threads} threads, rows kept on chip sized for the bound), "
                     "loops to the bound under a guard (valid for every length within it; no vector accesses)")
    vector = 1
    if (rows.within_max is not None and not rows.bounded and not thread_per_row
            and any(not v.has_reduction and static_product(v.extents[rank:]) > 1 for v in kept)):
        vector, threads = _vector_mapping(kept, rows.within_max, threads, spec)
        if vector > 1:
            notes.append(f"{vector * _widest_bytes(kept) * 8}-bit accesses: {vector} elements per thread "
                         "in element-wise loops")
    # Each reduced value: (bytes, outputs per row); with fewer outputs than threads, threads share it.
    reductions = tuple(
        (max(1, w.buffer.dtype.bits // 8),
         _row_elements((e for e, r in zip(v.extents[rank:], v.is_reduce[rank:]) if not r), rows.bounds) or 0)
        for v in kept if v.has_reduction for w in v.writes)
    shared_rows = list(shared_rows)

    def shared_at(rows_per_block: int, buffers: list | None = None) -> int:
        """Static shared bytes of a block of `rows_per_block` rows (of `buffers`, default: those kept so far)."""
        return cuda_shared_bytes(shared_rows if buffers is None else buffers, reductions, threads, rows_per_block,
                                 spec.warp_size)

    cached_inputs = []
    for buffer in _cacheable_inputs(kept, buffer_params(analysis.func), rank):
        row_bytes = _row_bytes(buffer, rank, rows.bounds)
        if thread_per_row:
            cached_inputs.append(buffer.name)
        elif row_bytes is not None and shared_at(1, shared_rows + [row_bytes]) <= limit:
            cached_inputs.append(buffer.name)
            shared_rows.append(row_bytes)
    shared = shared_at(1)
    if shared > limit or symbolic_shared:
        view_of = {v.name: v for v in analysis.views}
        demotable = sorted((i for i in intermediates if i.level == SHARED and i.name not in analysis.outputs
                            and not view_of[i.name].has_reduction and len(view_of[i.name].writes) == 1
                            and (not symbolic_shared or i.name in symbolic_shared)),
                           key=lambda i: -i.bytes_per_row)
        ends = analysis.depth_limit and rank == analysis.depth
        stop = f" (rows end at axis {rank}: {analysis.depth_limit})" if ends else ""
        excess = (f"{', '.join(symbolic_shared)}: a row of symbolic length cannot have a static shared buffer{stop}"
                  if symbolic_shared else
                  f"{shared} bytes of shared memory per row (intermediates, cached inputs, reduction "
                  f"staging) exceed {limit} of shared memory")
        raise SharedMemoryError(excess, [i.name for i in demotable], rows.bounded)
    if rows.bounded and rows.within_max > threads and not cached_inputs and not any(
            i.level == SHARED and i.bytes_per_row >= rows.within_max for i in intermediates):
        # Each thread would loop to the bound, a short row idling through it, for nothing kept on chip.
        raise SharedMemoryError(f"nothing of a row of {rows.within_max} elements is kept on chip", [],
                                rows.bounded)
    rows_per_task = _rows_per_block(rows.rows, threads, shared_at, rows.spatial_only, spec)
    if rows.rows is None and threads > 1:
        notes.append("symbolic row count: one row per block, grid from the runtime extent "
                     "(valid for every size; short rows are not packed, few long rows not split)")
    if rows_per_task > 1 and threads > 1:
        notes.append(f"short rows: {rows_per_task} rows packed per block of {threads * rows_per_task} threads")
    grid = rows.rows // rows_per_task if rows.rows is not None else -1
    mapping = ThreadMapping(rows.rows if rows.rows is not None else -1, rows_per_task, threads, vector, grid)
    return mapping, shared_at(rows_per_task), cached_inputs, notes, shared_rows, reductions


def _cpu_mapping(analysis: Analysis, rows: _Rows, spec: TargetSpec) -> tuple:
    """(mapping, notes) of a CPU row-resident plan: cores over row tasks, vector lanes, and for
    columns or few long rows the chunks a row is cut into."""
    views, kept = analysis.views, analysis.kept
    notes = []
    work = max(static_product(v.extents) or CPU_PARALLEL_MIN_WORK for v in views)
    threads = spec.cores if work >= CPU_PARALLEL_MIN_WORK else 1
    out_dtype = views[-1].writes[0].buffer.dtype
    # Half precision computes in float32 on the CPU (precision.py): lanes of float32 at least.
    lanes = spec.vector_bytes * 8 // max(32, out_dtype.bits)
    # Emulated half precision gains nothing from wide vectors: each lane converts alone,
    # unless the CPU converts float16 vectors (x86 F16C).
    emulated = str(out_dtype) in EMULATED_ON_CPU and not (str(out_dtype) == "float16" and spec.converts_half)
    vector = 1 if emulated else max(1, lanes)
    rows_per_task, split = 1, 1
    if rows.columns:
        rows_per_task = _cpu_stream_rows(rows.rows, threads)
    elif rows.rows is not None and rows.within_max is not None and threads > 1:
        split = _cpu_row_chunks(rows.rows, rows.within_max, threads)
        if split > 1:
            notes.append(f"few long rows: each row cut into {split} chunks over the cores, one parallel "
                         "loop per block, reductions as per-chunk partials then combined; "
                         "intermediates between blocks in memory")
    grid = rows.rows // rows_per_task if rows.rows is not None else -1
    if rows.rows is None:
        notes.append("symbolic row count: row tasks in parallel over the runtime rows "
                     "(valid for every size; few long rows are not cut into chunks)")
    if rows_per_task > 1:
        notes.append(f"rows are columns of the inputs: {rows_per_task} adjacent rows per task, "
                     "streamed down the reduction axis in vector lanes")
        reduced = max(static_product(e for e, r in zip(v.extents[rows.rank:], v.is_reduce[rows.rank:]) if r) or 1
                      for v in kept)
        split = -(-reduced // CPU_SPLIT_CHUNK)
        if split > 1:
            notes.append(f"reduction of {reduced} cut into {split} chunks: partials in parallel, then combined")
    mapping = ThreadMapping(rows.rows if rows.rows is not None else -1, rows_per_task, threads, vector, grid, split)
    return mapping, notes


def plan_kernel(func: tirx.PrimFunc, spec: TargetSpec, name: str, columns: bool = True) -> StitchPlan:
    """The plan of a fused PrimFunc for the target `spec` describes.

    CUDA: few long rows take the row-split scheme (global stitching over
    several blocks per row). Otherwise row-resident; when its intermediates
    need more shared memory than a block has, they are demoted one at a time,
    largest first, to recomputation in their consumers, and when only
    reduction results and outputs are left on chip, the group is stitched
    through global memory by row-split. `columns=False`: no column-split plan (the thread per
    column walk, which packing can share a launch with others).
    """
    moved, row_axes = _rows_moved_first(func, spec.family)
    if spec.family != "cuda":
        plan = plan_row_resident(moved, spec, name)
    else:
        plan = with_resources(_cuda_plan(moved, spec, name, columns))
    if not row_axes:
        return plan
    positions = sorted({p for _, p, _ in row_axes})
    split = sorted({k for _, _, factors in row_axes for k in factors if k})
    note = (f"rows are not the leading axes: block iterators {', '.join(map(str, positions))} "
            f"(of {len(row_axes)} blocks) moved first"
            + (f", split by {', '.join(map(str, split))} where a row is a quotient" if split else "")
            + "; the kernel's tensors are read and written as strided slices per row")
    return dataclasses.replace(plan, row_axes=row_axes, notes=plan.notes + (note,))


def _rows_moved_first(func: tirx.PrimFunc, family: str) -> tuple:
    """(func with its row axes first, the row axes) when its blocks share more rows at axes that
    do not lead than at leading ones (BatchNorm on NCHW: the channel, where no leading axis is
    shared; GroupNorm: (batch, group), where only the batch leads); else (func, ())."""
    try:
        leading = _row_count(analyse(func, family))
    except PlanError:
        return func, ()  # the plan below says why
    row_axes = find_row_axes(func)
    if row_axes is None or leading is None:
        return func, ()
    try:
        moved = rows_first(func, row_axes)
        if (_row_count(analyse(moved, family)) or 0) <= leading:
            return func, ()
    except (PlanError, s_tir.ScheduleError):
        return func, ()
    return moved, row_axes


def _row_count(analysis: Analysis) -> int | None:
    """Row tasks at the aligned depth (1 at depth 0; None when symbolic)."""
    return static_product(analysis.kept[0].extents[:analysis.depth]) if analysis.kept else None


def _cuda_plan(func: tirx.PrimFunc, spec: TargetSpec, name: str, columns: bool = True) -> StitchPlan:
    try:
        split = plan_row_split(func, spec, name, few_long_rows_only=True)
    except SplitError as err:
        split, not_split = None, err
    try:  # column reductions: columns x rows of threads; a combine launch only where the split takes one
        if columns:
            return plan_column_split(func, spec, name, combine_allowed=split is not None and split.kernels > 1)
    except ColumnError:
        pass
    if split is not None:
        return split
    recompute = ()
    while True:
        try:
            plan = plan_row_resident(func, spec, name, recompute)
            if 0 < plan.mapping.grid < spec.sms:
                # The plan says why the idle SMs are left idle.
                plan = dataclasses.replace(plan, notes=plan.notes + (
                    f"{plan.mapping.grid} blocks for {spec.sms} SMs, not split over more: {not_split}",))
            return plan
        except SharedMemoryError as err:
            if err.demotable:  # AStitch's demotion, one intermediate at a time, largest first
                recompute += (err.demotable[0],)
                continue
            if err.bounded:
                # Planned for the bound, no part of the row fits on chip: streamed, as for any length.
                sizes = ", ".join(f"{n} <= {u}" for n, u in err.bounded)
                plan = _cuda_plan(func.without_attr(SIZE_BOUNDS), spec, name, columns)
                return dataclasses.replace(plan, notes=plan.notes + (
                    f"planned for the bound of its symbolic length ({sizes}), no row-sized part stays on "
                    f"chip ({err}): streamed instead",))
            try:
                return plan_row_split(func, spec, name, few_long_rows_only=False)
            except SplitError as split_err:
                raise PlanError(f"{err}; and no row-split plan: {split_err}") from err

