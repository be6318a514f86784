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

A sum of exp(a - max) whose max reduces the same `a` over the row (softmax,
log-sum-exp) is one pass (online softmax): each chunk's partial is the sum
of exp(a - m_c) with m_c the chunk's own partial max, and the combine
rescales it, S = sum_c s_c * exp(m_c - M). Its partials then run in the max's
kernel, saving the kernel between them.

A sum of squared deviations (a - m)^2 whose shift m is a per-row function of
a sum S of the same `a` (BatchNorm's and LayerNorm's variance around the
mean) is one pass too: each chunk's partial is q_c = sum of (a - m_c)^2 with
m_c the shift its own partial s_c gives (m with S = s_c * split), and the
combine adds, exactly, q_c + (m_c - M) * (2 * (s_c - n_c * m_c) + n_c * (m_c - M))
with M the shift of the combined S and n_c the chunk length. Its partials run
in the sum's kernel.

Element-wise intermediates are inlined into each kernel that reads them:
recomputing them (even exp) costs less than a round trip through global
memory. The number of kernels is one more than the longest chain of
reductions. A grid-wide barrier would make it one kernel, but it needs a
cooperative launch (every block resident) that TVM's runtime does not make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_stitch.analysis.row_alignment import analyze_rows, walks_columns
from tvm_stitch.analysis.tir_view import block_consumers, buffer_params, static_int, static_product, vars_in
from tvm_stitch.planning.common import (Analyses, PlanError, block_threads, check_describable, inline_trial,
                                        output_blocks, recompute_in_readers, wanted_blocks)
from tvm_stitch.planning.common import views as views_of
from tvm_stitch.planning.plan import (GLOBAL, REGISTER, Intermediate, Phase, PhaseRole, StitchPlan,
                                      ThreadMapping)
from tvm_stitch.planning.resources import cuda_shared_bytes
from tvm_stitch.planning.spec import TargetSpec

# Rows fewer than the SMs (spec.sms) and at least this long are split.
SPLIT_MIN_ROW = 16384  # elements: 64 KB of float32, more than a block's shared memory
MIN_CHUNK = 2048  # elements per (row, chunk) block: enough loads in flight per block
MIN_COLUMN_CHUNK = 128  # column access: elements one thread walks per chunk
MIN_COLUMN_WALK = 8192  # column access: shorter walks keep the fewest launches (no combine kernel)
MAX_CHOSEN_KERNELS = 3  # a split chosen for parallelism alone: at most this many launches
STARVED_BLOCKS = 16  # below this many blocks, a launch that only combines partials pays for itself


class SplitError(PlanError):
    """The group does not have the shape the row-split scheme handles; `reason` says why."""


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


def _kept_blocks(func: tirx.PrimFunc, analyses: Analyses | None = None) -> tuple:
    """(views, outputs, inlined views, kept views, rank, online pairs, variance pairs, recomputed): the blocks
    once every element-wise block that is not an output is inlined, the rows they share, and the
    (sum, max) and (squared deviations, sum) reductions that take one pass (`online_pairs`,
    `variance_pairs`), and the outputs recomputed by their readers (`_recomputed_outputs`)."""
    func, recomputed = _recomputed_outputs(func, analyses)
    views = views_of(func, analyses)
    outputs = output_blocks(views, func)
    inlined = [v for v in views if v.name not in outputs and not v.has_reduction]
    trial, kept = inline_trial(func, [v.name for v in inlined], SplitError, analyses)
    check_describable(kept, SplitError)
    for view in kept:
        if len(view.writes) != 1:
            raise SplitError("split-writes-several", block=view.name)
    rank = analyze_rows(trial.mod["main"], kept).depth
    if rank == 0:
        raise SplitError("split-no-row-axis")
    return (views, outputs, inlined, kept, rank, online_pairs(trial, kept, rank), variance_pairs(trial, kept),
            recomputed)


def _recomputed_outputs(func: tirx.PrimFunc, analyses: Analyses | None = None) -> tuple:
    """(func with its element-wise outputs that other blocks read recomputed by those readers,
    their names): a reader then waits for what the output reads, not for the output itself
    (`recompute_in_readers`; a per-row mean read by the variance in the same kernel)."""
    views = views_of(func, analyses)
    outputs = output_blocks(views, func)
    names = tuple(v.name for v in views if v.name in outputs and not v.has_reduction and len(v.writes) == 1
                  and any(r.buffer.same_as(v.writes[0].buffer) for other in views if other is not v
                          for r in other.reads))
    if not names:
        return func, ()
    sch = s_tir.Schedule(func)
    try:
        recompute_in_readers(sch, names)
    except s_tir.ScheduleError:
        return func, ()
    return sch.mod["main"], names


def _row_length(kept: list, rank: int) -> int:
    """The one length every chunked block has inside a row (SplitError if they differ)."""
    lengths = set()
    for view in kept:
        spatial, reduce = _within(view, rank)
        if spatial is None or reduce is None:
            raise SplitError("split-symbolic-length", block=view.name)
        if view.has_reduction and spatial != 1:
            raise SplitError("split-reduction-outputs", block=view.name, outputs=spatial)
        if view.has_reduction or spatial > 1:  # a per-row value (spatial 1) is computed whole by each block
            lengths.add(reduce if view.has_reduction else spatial)
    if len(lengths) != 1:
        raise SplitError("split-lengths-differ")
    return lengths.pop()


@dataclass(frozen=True)
class _Kernels:
    """Which kernel each kept block runs in, and where each reduction's partials are combined."""

    level: dict  # kept block -> kernel of its values (a reduction: of its partials)
    combine: dict  # reduction -> kernel that combines its partials (its first reader's)
    readers: dict  # kept block -> kernels of the blocks that read it
    count: int  # kernels in all


def _kernels(kept: list, online: tuple = ()) -> _Kernels:
    """The kernels; a one-pass pair (online softmax's (sum, max), a variance's (squared
    deviations, sum)): the first's partials do not wait for the second's combine, and the
    first's combine reads the combined second."""
    consumers = block_consumers(kept)
    for total, peak in online:
        consumers[peak].discard(total)
    level = _levels(kept, consumers)
    readers = {name: [level[c] for c in users] for name, users in consumers.items()}

    def combined(name: str) -> int:  # a reduction's combine runs in its first reader's kernel
        return min(readers[name], default=level[name] + 1)

    combine = {view.name: combined(view.name) for view in kept if view.has_reduction}
    for total, peak in online:
        readers[peak].append(combine[total])
        combine[peak] = combined(peak)
    return _Kernels(level, combine, readers, max(list(level.values()) + list(combine.values())) + 1)


def _reduction_parts(block):
    """(init value, buffer, load of the old value, the other operand, combiner) of a reduction
    block `r = combiner(r, value)` that writes one buffer; None for another shape."""
    body, init = block.body, block.init
    if not isinstance(body, tirx.BufferStore) or not isinstance(init, tirx.BufferStore):
        return None
    value = body.value
    if not isinstance(value, (tirx.Max, tirx.Add)):
        return None
    old = value.a
    if not (isinstance(old, tvm.ir.TensorLoad) and old.source.same_as(body.buffer)
            and tvm_ffi.structural_equal(old.indices, body.indices)):
        return None
    return init.value, body.buffer, old, value.b, type(value)


def _kept_reductions(trial: s_tir.Schedule, kept: list) -> tuple:
    """({name: block}, {name: its `_reduction_parts`}) of the kept blocks that reduce."""
    blocks = {v.name: trial.get(trial.get_sblock(v.name)) for v in kept if v.has_reduction}
    return blocks, {name: _reduction_parts(block) for name, block in blocks.items()}


def _sums_from_zero(parts: dict) -> dict:
    """The reductions of `parts` that add from 0."""
    return {name: p for name, p in parts.items() if p is not None and p[4] is tirx.Add and _is_const(p[0], 0.0)}


def _reads_buffer(expr, buffer) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, lambda load: found.append(load.source.same_as(buffer))),
                            order="post")
    return any(found)


def online_pairs(trial: s_tir.Schedule, kept: list, rank: int) -> tuple:
    """(sum, max) pairs of kept reductions that take one pass per chunk: the max reduces `a`
    from a finite identity, the sum adds exp(a - max) from 0 (float casts around the exp and its
    argument allowed: they round each term as the unsplit sum does), with the same `a` over the
    same iterators (so every exp(a - m_c) <= 1), reading the max only through its row value (one
    per row: `_row_length` checks it)."""
    blocks, parts = _kept_reductions(trial, kept)
    sums = _sums_from_zero(parts)
    pairs = []
    for total, sum_parts in sums.items():
        term = _uncast(sum_parts[3])
        if not (isinstance(term, tvm.ir.Call) and term.op.name == "tirx.exp"
                and isinstance(_uncast(term.args[0]), tirx.Sub)):
            continue
        shifted, peak_load = _uncast(term.args[0]).a, _uncast(term.args[0]).b
        if not isinstance(peak_load, tvm.ir.TensorLoad) or _reads_buffer(shifted, peak_load.source):
            continue
        for peak, max_parts in parts.items():
            if (max_parts is None or max_parts[4] is not tirx.Max or not max_parts[1].same_as(peak_load.source)
                    or not isinstance(max_parts[0], tirx.FloatImm) or not math.isfinite(max_parts[0].value)
                    or any(p == peak for _, p in pairs)):  # one sum per max: its chunk max is staged once
                continue
            iters = _same_iterators(blocks[peak], blocks[total])
            if iters is None:
                continue
            same_a = tvm_ffi.structural_map(max_parts[3], (tirx.Var, lambda v, iters=iters: iters.get(v, v)))
            if (tvm_ffi.structural_equal(peak_load.indices[:rank], sum_parts[2].indices[:rank])
                    and tvm_ffi.structural_equal(max_parts[1].shape, sum_parts[1].shape)
                    and tvm_ffi.structural_equal(same_a, shifted)):
                pairs.append((total, peak))
    return tuple(pairs)


def _loads(expr, buffer=None) -> list:
    """The loads in `expr` (of `buffer` only, if given)."""
    found = []
    tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, lambda load: found.append(load)
                                   if buffer is None or load.source.same_as(buffer) else None), order="post")
    return found


def variance_pairs(trial: s_tir.Schedule, kept: list) -> tuple:
    """(squared deviations, sum) pairs of kept reductions that take one pass per chunk: the first
    adds (a - m) * (a - m) from 0, the second adds the same `a` from 0 over the same iterators
    (either through a float cast to the sums' dtype: half-precision `a` and squares summed in float32),
    and the shift m reads nothing but the second's result (at the row's point: none of the
    first's reduction iterators in its indices) and constants."""
    blocks, parts = _kept_reductions(trial, kept)
    sums = _sums_from_zero(parts)
    pairs = []
    for squares, sq_parts in sums.items():
        term = _uncast(sq_parts[3])  # half-precision squares are cast to the float32 sum
        if not (isinstance(term, tirx.Mul) and tvm_ffi.structural_equal(term.a, term.b)
                and isinstance(term.a, tirx.Sub)):
            continue
        a, shift = term.a.a, term.a.b
        reduce_vars = {iv.var for iv in blocks[squares].iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
        for total, sum_parts in sums.items():
            if total == squares or any(p == total for _, p in pairs):
                continue
            loads = _loads(shift, sum_parts[1])
            if not loads or _reads_buffer(a, sum_parts[1]) or any(vars_in(i) & reduce_vars for l in loads
                                                                   for i in l.indices):
                continue
            rest = tvm_ffi.structural_map(shift, (tvm.ir.TensorLoad, lambda load, s=sum_parts[1]: tirx.const(
                0, load.ty) if load.source.same_as(s) else load))
            if vars_in(rest) or _loads(rest):
                continue
            iters = _same_iterators(blocks[total], blocks[squares])
            if iters is None:
                continue
            same_a = tvm_ffi.structural_map(sum_parts[3], (tirx.Var, lambda v, iters=iters: iters.get(v, v)))
            if (tvm_ffi.structural_equal(_uncast(same_a), _uncast(a)) and str(sum_parts[1].dtype) == str(sq_parts[1].dtype)
                    and tvm.DataType(str(_uncast(a).ty)).bits <= tvm.DataType(str(sq_parts[1].dtype)).bits
                    and tvm_ffi.structural_equal(sq_parts[1].shape, sum_parts[1].shape)):
                pairs.append((squares, total))
    return tuple(pairs)


def _same_iterators(a, b):
    """{iterator of block a: b's} when both blocks iterate the same domains the same way; else None."""
    if len(a.iter_vars) != len(b.iter_vars):
        return None
    for x, y in zip(a.iter_vars, b.iter_vars):
        if x.iter_type != y.iter_type or not tvm_ffi.structural_equal(x.dom, y.dom):
            return None
    return {x.var: y.var for x, y in zip(a.iter_vars, b.iter_vars)}


def _uncast(expr):
    """`expr` without the float casts around it (float16 softmax: exp in float32, summed in float32)."""
    while isinstance(expr, tirx.Cast) and str(expr.ty).startswith("float"):
        expr = expr.value
    return expr


def _is_const(expr, value: float) -> bool:
    return isinstance(expr, (tirx.FloatImm, tirx.IntImm)) and expr.value == value


def _check_worth_splitting(kept: list, rank: int, kernels: _Kernels, unsplit_blocks: int) -> None:
    """For a split chosen for parallelism alone: few launches, and no launch that only combines
    unless the GPU is starved without the split."""
    if kernels.count > MAX_CHOSEN_KERNELS:
        raise SplitError("split-too-many-kernels", kernels=kernels.count)
    chunked = {kernels.level[v.name] for v in kept if v.has_reduction or _within(v, rank)[0] > 1}
    if unsplit_blocks >= STARVED_BLOCKS and len(chunked) < kernels.count:
        raise SplitError("split-not-starved", blocks=unsplit_blocks)


def _mapping(rows: int, length: int, columns: bool, dtype_bytes: int, spec: TargetSpec,
             split: int | None = None) -> ThreadMapping:
    """Blocks per row and threads per block: column walks a warp of rows per block, one thread
    each; rows chunked over blocks (`split` of them, default chosen), each chunk over a block's
    threads with vector accesses."""
    if split is not None and (length % split or length // split < (MIN_COLUMN_CHUNK if columns else MIN_CHUNK)):
        raise SplitError("split-not-whole-chunks", split=split, length=length)
    if columns:
        row_blocks = -(-rows // spec.warp_size)
        if split is None:
            split = choose_split(row_blocks, length, spec, MIN_COLUMN_CHUNK) if row_blocks < spec.sms else 1
        return ThreadMapping(rows, spec.warp_size, 1, 1, row_blocks * split, split=split)
    if split is None:
        split = choose_split(rows, length, spec) if rows < spec.sms else 1
    chunk = length // split
    vector = spec.vector_bytes // dtype_bytes
    threads = block_threads(spec)
    while threads > spec.warp_size and threads * vector > chunk:
        threads //= 2
    vector = vector if chunk % (threads * vector) == 0 else 1
    return ThreadMapping(rows, 1, threads, vector, rows * split, split=split)


def _intermediates(views: list, inlined: list, kept: list, outputs: set, kernels: _Kernels, split: int,
                   dtype_bytes: int) -> list:
    """Element-wise blocks inlined into every kernel that reads them; per reduction its partials
    in global memory, and its combined value in a register or, read by a later kernel or the
    caller, in global memory too."""
    out = [Intermediate(v.name, REGISTER, dtype_bytes, "recomputed in every kernel that reads it: "
                        "cheaper than a round trip through global memory", inlined=True)
           for v in reversed(inlined) if any(r.buffer.same_as(v.writes[0].buffer) for k in views for r in k.reads)]
    for view in kept:
        if not view.has_reduction:
            continue
        nbytes = max(1, view.writes[0].buffer.dtype.bits // 8)
        combine = kernels.combine[view.name]
        out.append(Intermediate(f"{view.name}_rf", GLOBAL, split * nbytes,
                                f"{split} partials per row from kernel {kernels.level[view.name]}, "
                                f"combined in kernel {combine}"))
        later = [lvl for lvl in kernels.readers[view.name] if lvl > combine]
        if view.name in outputs or later:
            why = "kernel output" if view.name in outputs else f"read again in kernel {min(later)}"
            out.append(Intermediate(view.name, GLOBAL, nbytes, f"combined per row; {why}"))
        else:
            out.append(Intermediate(view.name, REGISTER, nbytes, "combined per row by each thread that reads it"))
    return out


def _notes(mapping: ThreadMapping, length: int, columns: bool, kernels: _Kernels, inlined: list,
           online: tuple, variance: tuple) -> list:
    m = mapping
    if columns:
        first = (f"column access: {m.rows} threads walk columns of {length} in {m.split} chunks, {m.grid} blocks "
                 f"of {m.rows_per_task} threads")
    elif m.split > 1:
        first = f"few long rows: {m.rows} rows of {length} split into {m.split} chunks, {m.grid} blocks"
    else:
        first = f"rows of {length} do not fit on chip: kernels cut at reductions"
    notes = [
        first,
        f"global stitching in {kernels.count} kernels (partials, then per-row combines); no grid barrier: "
        "TVM's runtime has no cooperative launch to guarantee every block is resident",
    ]
    for total, peak in online:
        notes.append(f"online softmax: {total}'s partials sum exp(x - {peak}'s chunk max) in {peak}'s pass, "
                     "rescaled when combined")
    for squares, total in variance:
        notes.append(f"one-pass variance: {squares}'s partials square deviations from the chunk's own shift "
                     f"(from {total}'s partial) in {total}'s pass, corrected exactly when combined")
    if any(v.expensive for v in inlined):
        notes.append("expensive element-wise ops are recomputed in each kernel that reads them")
    return notes


def plan_row_split(func: tirx.PrimFunc, spec: TargetSpec, name: str, few_long_rows_only: bool = False,
                   split: int | None = None, analyses: Analyses | None = None) -> StitchPlan:
    """The row-split plan; with `few_long_rows_only`, only for rows that `wants_split`; `split`
    sets the chunks per row (default: choose_split's); `analyses`: the kept blocks found once."""
    if spec.family != "cuda":
        raise SplitError("split-cuda-only")
    kept_blocks = (_kept_blocks(func) if analyses is None else
                   analyses.made(func, ("row-split",), lambda: _kept_blocks(func, analyses)))
    views, outputs, inlined, kept, rank, online, variance, recomputed = kept_blocks
    rows = static_product(kept[0].extents[:rank])
    if rows is None:
        raise SplitError("split-symbolic-rows")
    length = _row_length(kept, rank)
    columns = walks_columns(kept, buffer_params(func), rank)
    # Column access (e.g. dgamma, BatchNorm over N): a thread per row walks its column;
    # splitting the walk gives blocks when there are few rows.
    unsplit_blocks = -(-rows // spec.warp_size) if columns else rows
    kernels = _kernels(kept, online + variance)
    if few_long_rows_only:
        if columns and (unsplit_blocks >= spec.sms or length < MIN_COLUMN_WALK):
            raise SplitError("split-enough-columns", rows=rows, length=length)
        if not columns and not wants_split(rows, length, spec):
            raise SplitError("split-resident-fits", rows=rows, length=length)
        _check_worth_splitting(kept, rank, kernels, unsplit_blocks)
    dtype_bytes = max(1, max(v.writes[0].buffer.dtype.bits for v in kept) // 8)
    mapping = _mapping(rows, length, columns, dtype_bytes, spec, split)
    # A kernel holds the partials or the combine of each reduction at most once; every reduced
    # value is counted as shared by the block's threads (a bound on TVM's all-reduce staging).
    reductions = tuple((max(1, w.buffer.dtype.bits // 8), 0) for v in kept if v.has_reduction for w in v.writes)
    return StitchPlan(
        kernel=name,
        target="cuda",
        scheme="row-split",
        ops=tuple(v.name for v in views),
        dominant=tuple(v.name for v in kept if v.has_reduction) or (kept[-1].name,),
        rank=rank,
        row_shape=tuple(str(static_int(e)) for e in kept[0].extents[:rank]),
        mapping=mapping,
        intermediates=tuple(_intermediates(views, inlined, kept, outputs, kernels, mapping.split, dtype_bytes)),
        outputs=tuple(v.name for v in views if v.name in outputs),
        phases=tuple(Phase(v.name, kernels.level[v.name]) for v in kept) + tuple(
            Phase(n, lvl, PhaseRole.COMBINE) for n, lvl in kernels.combine.items()),
        kernels=kernels.count,
        online=online,
        variance=variance,
        recomputed_outputs=recomputed,
        shared_bytes=cuda_shared_bytes((), reductions, mapping.threads, mapping.rows_per_task, spec.warp_size),
        shared_reductions=reductions,
        reductions=sum(1 for v in kept if v.has_reduction),
        notes=tuple(_notes(mapping, length, columns, kernels, inlined, online, variance)),
        spec=spec,
    )
