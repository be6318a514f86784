"""Rules for the row-split scheme (CUDA): few long rows, stitched through global memory.

When a group has fewer row tasks than the GPU has SMs and its rows are too
long to keep on chip, the row-resident scheme would leave most SMs idle and
spill its row intermediates. Row-split instead cuts every row into `split`
chunks, one thread block per (row, chunk), and runs the group as a short
sequence of kernels (global stitching, AStitch's scheme for values consumed
across blocks):

- kernel k computes, per chunk, a partial of every reduction of level k
  (rfactor), and the element-wise outputs of level k;
- the partials of a reduction are combined, per row, at the start of the
  first later kernel that reads it (each thread combines the `split`
  partials itself, so no grid-wide barrier is needed); a combined value that
  a still later kernel or the caller needs is written to global memory.

Groups that walk columns (a thread per row steps down a strided axis:
dgamma, BatchNorm statistics) get the same split with rows across threads,
so loads stay coalesced and the walk is cut into chunks over blocks.

Element-wise intermediates are inlined into each kernel that reads them:
recomputing them (even exp) costs less than a round trip through global
memory. The number of kernels is one more than the longest chain of
reductions. A grid-wide barrier would make it one kernel, but it needs a
cooperative launch (every block resident) that TVM's runtime does not make.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from tvm_stitch.analysis.row_alignment import analyze_rows, walks_columns
from tvm_stitch.analysis.tir_view import block_consumers, block_views, static_int, static_product
from tvm_stitch.planning.common import (PlanError, block_threads, check_describable, inline_trial, output_blocks,
                                        wanted_blocks)
from tvm_stitch.planning.plan import (GLOBAL, REGISTER, Intermediate, Phase, PhaseRole, StitchPlan,
                                      ThreadMapping)
from tvm_stitch.planning.spec import TargetSpec

# Rows fewer than the SMs (spec.sms) and at least this long are split.
SPLIT_MIN_ROW = 16384  # elements: 64 KB of float32, more than a block's shared memory
MIN_CHUNK = 2048  # elements per (row, chunk) block: enough loads in flight per block
MIN_COLUMN_CHUNK = 128  # column access: elements one thread walks per chunk
MIN_COLUMN_WALK = 8192  # column access: shorter walks keep the fewest launches (no combine kernel)
MAX_CHOSEN_KERNELS = 3  # a split chosen for parallelism alone: at most this many launches
STARVED_BLOCKS = 16  # below this many blocks, a launch that only combines partials pays for itself


class SplitError(PlanError):
    """The group does not have the shape the row-split scheme handles; the message says why."""


def wants_split(rows: int | None, row_length: int | None, spec: TargetSpec) -> bool:
    """Few, long rows: row-resident would leave SMs idle and could not keep a row on chip."""
    return rows is not None and row_length is not None and rows < spec.sms and row_length >= SPLIT_MIN_ROW


def choose_split(blocks: int, row_length: int, spec: TargetSpec, min_chunk: int = MIN_CHUNK) -> int:
    """Chunks per row: the fewest that give `wanted_blocks` blocks, dividing the row, chunks >= min_chunk."""
    best = 1
    for split in range(2, row_length // min_chunk + 1):
        if row_length % split:
            continue
        best = split
        if blocks * split >= wanted_blocks(spec):
            break
    return best


def _within(view, rank: int) -> tuple:
    """(spatial extent, reduction extent) of a block inside a row; None where symbolic."""
    spatial = static_product(e for e, r in zip(view.extents[rank:], view.is_reduce[rank:]) if not r)
    reduce = static_product(e for e, r in zip(view.extents[rank:], view.is_reduce[rank:]) if r)
    return spatial, reduce


def _levels(kept: list, consumers: dict) -> dict:
    """Kernel index of every kept block (program order): one after the latest kept block it reads."""
    level = {}
    for view in kept:
        level[view.name] = max((level[p] + 1 for p, users in consumers.items() if view.name in users and p in level),
                               default=0)
    return level


def _kept_blocks(func: tirx.PrimFunc) -> tuple:
    """(views, outputs, inlined views, kept views, rank): the blocks once every element-wise block
    that is not an output is inlined, and the rows they share."""
    views = block_views(s_tir.Schedule(func))
    outputs = output_blocks(views, func)
    inlined = [v for v in views if v.name not in outputs and not v.has_reduction]
    trial, kept = inline_trial(func, [v.name for v in inlined], SplitError)
    check_describable(kept, SplitError)
    for view in kept:
        if len(view.writes) != 1:
            raise SplitError(f"block {view.name} writes several buffers")
    rank = analyze_rows(trial.mod["main"], kept).depth
    if rank == 0:
        raise SplitError("no row axis shared by all blocks")
    return views, outputs, inlined, kept, rank


def _row_length(kept: list, rank: int) -> int:
    """The one length every chunked block has inside a row (SplitError if they differ)."""
    lengths = set()
    for view in kept:
        spatial, reduce = _within(view, rank)
        if spatial is None or reduce is None:
            raise SplitError(f"block {view.name}: symbolic extent inside a row")
        if view.has_reduction and spatial != 1:
            raise SplitError(f"block {view.name}: reduction with {spatial} outputs per row")
        if view.has_reduction or spatial > 1:  # a per-row value (spatial 1) is computed whole by each block
            lengths.add(reduce if view.has_reduction else spatial)
    if len(lengths) != 1:
        raise SplitError("blocks differ in row length")
    return lengths.pop()


def plan_row_split(func: tirx.PrimFunc, spec: TargetSpec, name: str,
                   few_long_rows_only: bool = False) -> StitchPlan:
    """The row-split plan; with `few_long_rows_only`, only for rows that `wants_split`."""
    if spec.family != "cuda":
        raise SplitError("row-split is a CUDA scheme")
    views, outputs, inlined, kept, rank = _kept_blocks(func)
    rows = static_product(kept[0].extents[:rank])
    if rows is None:
        raise SplitError("symbolic row count")
    length = _row_length(kept, rank)
    params = list(func.params)
    columns = walks_columns(kept, params, rank)
    if columns:
        # Column access (e.g. dgamma, BatchNorm over N): a thread per row walks its column;
        # splitting the walk gives blocks when there are few rows.
        row_blocks = -(-rows // spec.warp_size)
        if few_long_rows_only and (row_blocks >= spec.sms or length < MIN_COLUMN_WALK):
            raise SplitError(f"{rows} column walks of {length}: enough blocks without a split")
    elif few_long_rows_only and not wants_split(rows, length, spec):
        raise SplitError(f"{rows} rows of {length} elements: row-resident fits")

    consumers = block_consumers(kept)
    levels = _levels(kept, consumers)
    consumer_levels = {name: [levels[c] for c in users] for name, users in consumers.items()}
    # A reduction's partials run in its own kernel, their combine in its first reader's kernel.
    combine_level = {view.name: min(consumer_levels[view.name], default=levels[view.name] + 1)
                     for view in kept if view.has_reduction}
    kernels = max(list(levels.values()) + list(combine_level.values())) + 1
    if few_long_rows_only and kernels > MAX_CHOSEN_KERNELS:
        raise SplitError(f"{kernels} kernels: launches would cost more than idle SMs")
    unsplit_blocks = row_blocks if columns else rows
    chunked = {levels[v.name] for v in kept if v.has_reduction or _within(v, rank)[0] > 1}
    if few_long_rows_only and unsplit_blocks >= STARVED_BLOCKS and len(chunked) < kernels:
        raise SplitError(f"{unsplit_blocks} blocks without a split: not starved enough to pay a launch "
                         "that only combines")
    dtype_bytes = max(1, max(v.writes[0].buffer.dtype.bits for v in kept) // 8)
    if columns:
        # A warp of rows (columns) per block, one thread each.
        split = choose_split(row_blocks, length, spec, MIN_COLUMN_CHUNK) if row_blocks < spec.sms else 1
        threads, vector, rows_per_block, blocks = 1, 1, spec.warp_size, row_blocks * split
    else:
        split = choose_split(rows, length, spec) if rows < spec.sms else 1
        chunk = length // split
        vector = spec.vector_bytes // dtype_bytes
        threads = block_threads(spec)
        while threads > spec.warp_size and threads * vector > chunk:
            threads //= 2
        vector = vector if chunk % (threads * vector) == 0 else 1
        rows_per_block, blocks = 1, rows * split

    intermediates = [Intermediate(v.name, REGISTER, dtype_bytes, "recomputed in every kernel that reads it: "
                                  "cheaper than a round trip through global memory", inlined=True)
                     for v in reversed(inlined) if any(r.buffer.same_as(v.writes[0].buffer) for k in views for r in k.reads)]
    for view in kept:
        if not view.has_reduction:
            continue
        nbytes = max(1, view.writes[0].buffer.dtype.bits // 8)
        intermediates.append(Intermediate(
            f"{view.name}_rf", GLOBAL, split * nbytes,
            f"{split} partials per row from kernel {levels[view.name]}, combined in kernel {combine_level[view.name]}"))
        later = [lvl for lvl in consumer_levels[view.name] if lvl > combine_level[view.name]]
        if view.name in outputs or later:
            why = "kernel output" if view.name in outputs else f"read again in kernel {min(later)}"
            intermediates.append(Intermediate(view.name, GLOBAL, nbytes, f"combined per row; {why}"))
        else:
            intermediates.append(Intermediate(view.name, REGISTER, nbytes,
                                              "combined per row by each thread that reads it"))
    if columns:
        first = (f"column access: {rows} threads walk columns of {length} in {split} chunks, {blocks} blocks "
                 f"of {rows_per_block} threads")
    elif split > 1:
        first = f"few long rows: {rows} rows of {length} split into {split} chunks, {blocks} blocks"
    else:
        first = f"rows of {length} do not fit on chip: kernels cut at reductions"
    notes = [
        first,
        f"global stitching in {kernels} kernels (partials, then per-row combines); no grid barrier: "
        "TVM's runtime has no cooperative launch to guarantee every block is resident",
    ]
    if any(v.expensive for v in inlined):
        notes.append("expensive element-wise ops are recomputed in each kernel that reads them")
    dominant = tuple(v.name for v in kept if v.has_reduction) or (kept[-1].name,)
    return StitchPlan(
        kernel=name,
        target="cuda",
        scheme="row-split",
        ops=tuple(v.name for v in views),
        dominant=dominant,
        rank=rank,
        row_shape=tuple(str(static_int(e)) for e in kept[0].extents[:rank]),
        mapping=ThreadMapping(rows, rows_per_block, threads, vector, blocks, split=split),
        intermediates=tuple(intermediates),
        outputs=tuple(v.name for v in views if v.name in outputs),
        phases=tuple(Phase(v.name, levels[v.name]) for v in kept) + tuple(
            Phase(n, lvl, PhaseRole.COMBINE) for n, lvl in combine_level.items()),
        kernels=kernels,
        reductions=sum(1 for v in kept if v.has_reduction),
        notes=tuple(notes),
        spec=spec,
    )
