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

import tvm
from tvm import s_tir, tirx

from tvm_stitch.planning.plan import GLOBAL, REGISTER, Intermediate, StitchPlan, ThreadMapping
from tvm_stitch.analysis.row_alignment import analyze_rows, walks_columns
from tvm_stitch.analysis.tir_view import block_consumers, block_views, buffer_params, static_int, static_product

SPLIT_BELOW_ROWS = 132  # row tasks below one per SM of an H100/H200: split the rows
SPLIT_MIN_ROW = 16384  # elements: 64 KB of float32, more than a block's shared memory
WANTED_BLOCKS = 264  # two thread blocks per SM
MIN_CHUNK = 2048  # elements per (row, chunk) block: enough loads in flight per block
COLUMN_ROWS_PER_BLOCK = 32  # column access: a warp of rows (columns) per block, one thread each
MIN_COLUMN_CHUNK = 128  # column access: elements one thread walks per chunk
MIN_COLUMN_WALK = 8192  # column access: shorter walks keep the fewest launches (no combine kernel)
MAX_THREADS = 256
VECTOR_BYTES = 16  # 128-bit loads and stores
MAX_CHOSEN_KERNELS = 3  # a split chosen for parallelism alone: at most this many launches
STARVED_BLOCKS = 16  # below this many blocks, a launch that only combines partials pays for itself


class SplitError(Exception):
    """The group does not have the shape the row-split scheme handles; the message says why."""


def wants_split(rows: int | None, row_length: int | None) -> bool:
    """Few, long rows: row-resident would leave SMs idle and could not keep a row on chip."""
    return rows is not None and row_length is not None and rows < SPLIT_BELOW_ROWS and row_length >= SPLIT_MIN_ROW


def choose_split(blocks: int, row_length: int, min_chunk: int = MIN_CHUNK) -> int:
    """Chunks per row: the fewest that give WANTED_BLOCKS blocks, dividing the row, chunks >= min_chunk."""
    best = 1
    for split in range(2, row_length // min_chunk + 1):
        if row_length % split:
            continue
        best = split
        if blocks * split >= WANTED_BLOCKS:
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


def plan_row_split(func: tirx.PrimFunc, target: tvm.target.Target, name: str,
                   few_long_rows_only: bool = False) -> StitchPlan:
    """The row-split plan; with `few_long_rows_only`, only for rows that `wants_split`."""
    if target.kind.name != "cuda":
        raise SplitError("row-split is a CUDA scheme")
    views = block_views(s_tir.Schedule(func))
    params = buffer_params(func)
    outputs = {v.name for v in views if any(w.buffer.same_as(p) for w in v.writes for p in params)}
    trial = s_tir.Schedule(func)
    inlined = []
    for view in reversed(views):
        if view.name in outputs or view.has_reduction:
            continue
        try:
            trial.compute_inline(trial.get_sblock(view.name))
        except Exception as err:  # noqa: BLE001 - s_tir refuses: the scheme cannot hold this block
            raise SplitError(f"block {view.name} cannot be inlined: {str(err).strip().splitlines()[-1][:120]}")
        inlined.append(view)
    kept = block_views(trial)
    for view in kept:
        if not view.trivial_binding or not all(a.point for a in view.reads + view.writes):
            raise SplitError(f"block {view.name}: not a plain loop nest of point accesses")
        if len(view.writes) != 1:
            raise SplitError(f"block {view.name} writes several buffers")
    rank = analyze_rows(trial.mod["main"], kept).depth
    if rank == 0:
        raise SplitError("no row axis shared by all blocks")
    rows = static_product(kept[0].extents[:rank])
    lengths = set()
    for view in kept:
        spatial, reduce = _within(view, rank)
        if spatial is None or reduce is None:
            raise SplitError(f"block {view.name}: symbolic extent inside a row")
        if view.has_reduction and spatial != 1:
            raise SplitError(f"block {view.name}: reduction with {spatial} outputs per row")
        if view.has_reduction or spatial > 1:  # a per-row value (spatial 1) is computed whole by each block
            lengths.add(reduce if view.has_reduction else spatial)
    if rows is None or len(lengths) != 1:
        raise SplitError("blocks differ in row length" if rows is not None else "symbolic row count")
    length = lengths.pop()
    columns = walks_columns(kept, params, rank)
    if columns:
        # Column access (e.g. dgamma, BatchNorm over N): a thread per row walks its column;
        # splitting the walk gives blocks when there are few rows.
        row_blocks = -(-rows // COLUMN_ROWS_PER_BLOCK)
        if few_long_rows_only and (row_blocks >= SPLIT_BELOW_ROWS or length < MIN_COLUMN_WALK):
            raise SplitError(f"{rows} column walks of {length}: enough blocks without a split")
    elif few_long_rows_only and not wants_split(rows, length):
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
        split = choose_split(row_blocks, length, MIN_COLUMN_CHUNK) if row_blocks < SPLIT_BELOW_ROWS else 1
        threads, vector, rows_per_block, blocks = 1, 1, COLUMN_ROWS_PER_BLOCK, row_blocks * split
    else:
        split = choose_split(rows, length) if rows < SPLIT_BELOW_ROWS else 1
        chunk = length // split
        vector = VECTOR_BYTES // dtype_bytes
        threads = MAX_THREADS
        while threads > 32 and threads * vector > chunk:
            threads //= 2
        vector = vector if chunk % (threads * vector) == 0 else 1
        rows_per_block, blocks = 1, rows * split

    intermediates = [Intermediate(v.name, REGISTER, dtype_bytes, "recomputed in every kernel that reads it: "
                                  "cheaper than a round trip through global memory", inlined=True)
                     for v in inlined if any(r.buffer.same_as(v.writes[0].buffer) for k in views for r in k.reads)]
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
        phases=tuple((v.name, levels[v.name]) for v in kept) + tuple(
            (f"{n}:combine", lvl) for n, lvl in combine_level.items()),
        kernels=kernels,
        reductions=sum(1 for v in kept if v.has_reduction),
        notes=tuple(notes),
    )
