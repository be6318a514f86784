"""Rules for the column-split scheme (CUDA): reductions over leading or middle axes that fill the GPU.

A column reduction (a sum over the leading axis: LayerNorm backward's dgamma
and dbeta, a bias gradient, BatchNorm-style sums over a middle axis with a
contiguous kept axis) keeps the innermost axis of its input and reduces the
ones outside it. A thread per kept element walking its column serially
gives as many threads as there are columns (768 for a 4096x768 dgamma).
Column-split instead maps, per thread block:

- `threadIdx.x` along the contiguous kept axis, `vector` elements per thread
  (128-bit loads where the columns allow), a tile of `threads_x * vector`
  columns of at least one 32-byte sector per row;
- `threadIdx.y` along the reduced rows: each thread sums every
  `threads_y`-th row of its chunk, and the block combines its threads' sums
  in shared memory (TVM's cross-thread reduction over `threadIdx.y`);
- blocks over the column tiles (times the outer kept axes), and with
  `split > 1` over row chunks too.

With `split == 1` the kernel is one launch. With `split > 1` each (tile,
chunk) block writes a partial to global memory and a second kernel combines
the `split` partials per column (a thread per column). A last-block-done
counter would combine them in the same launch, but it needs a counter that
is zero before the launch, and TVM gives a kernel only uninitialised
workspace (no memset, no persistent device global): zeroing it would cost the
launch it saves. A grid-wide barrier needs a cooperative launch, which TVM's
runtime does not make. So the split is taken only where the thread-per-column
plan would already take a combine kernel (row_split's few-long-column-walks
rule): launch counts never rise.

Element-wise producers of the reductions are inlined into them (recomputed
per element: every element is read once). Element-wise outputs that read one
reduction's result (a mean's divide) are computed by the thread that
writes that result. A group with any other block (an element-wise output of
the full tensor, a value broadcast back over the rows) is not this scheme's:
PlanError, and the caller plans it as before.
"""

from __future__ import annotations

from tvm import tirx

from tvm_stitch.analysis.tir_view import static_int, static_product
from tvm_stitch.planning.cuda.fill import fill_threads
from tvm_stitch.planning.common import (Analyses, PlanError, check_describable, inline_trial, output_blocks,
                                        wanted_blocks)
from tvm_stitch.planning.common import views as views_of
from tvm_stitch.planning.plan import GLOBAL, REGISTER, Intermediate, StitchPlan, ThreadMapping
from tvm_stitch.planning.resources import column_split_registers, cuda_shared_bytes, register_budget
from tvm_stitch.planning.spec import TargetSpec

SECTOR_BYTES = 32  # the unit of a global-memory transaction: a tile spans at least one per row
MIN_ROWS_PER_THREAD = 4  # rows a thread sums at least before the block combines (loads in flight)
COMBINE_THREADS = 256  # threads per block of the combine kernel (split > 1): one per column
WHOLE_TENSOR_MIN = 1 << 20  # elements from which a whole-tensor reduction is cut over blocks (fewer: one block)


class ColumnError(PlanError):
    """The group is not a set of column reductions (with their element-wise epilogues)."""


def _reduction_shape(view) -> tuple:
    """(spatial extents, reduced elements) of a reduction block whose iterators are its spatial ones
    first, then its reduced ones; ColumnError otherwise."""
    flags = list(view.is_reduce)
    first = flags.index(True)
    if not all(flags[first:]):
        raise ColumnError("column-spatial-inside", block=view.name)
    spatial = [static_int(e) for e in view.extents[:first]]
    reduced = static_product(view.extents[first:])
    if None in spatial or reduced is None:
        raise ColumnError("column-symbolic", block=view.name)
    return tuple(spatial), reduced


def _check_contiguous(view) -> None:
    """Every multi-dimensional read of the block has its last spatial iterator as its innermost index,
    or a constant one (a per-row value such as a (rows, 1) mean, the same for every column): the kept
    axis is the contiguous one (a column reduction, not a row reduction)."""
    first = list(view.is_reduce).index(True)
    last = next(v for v, e in zip(reversed(view.iter_vars[:first]), reversed(view.extents[:first]))
                if static_int(e) != 1)
    for read in view.reads:
        if len(read.indices) < 2:
            continue
        inner = read.indices[-1]
        if not (isinstance(inner, tirx.Var) and inner.same_as(last)) and not isinstance(inner, tirx.IntImm):
            raise ColumnError("column-read-across", block=view.name, buffer=read.buffer.name)


def _kept(func: tirx.PrimFunc, analyses: Analyses | None = None) -> tuple:
    """(views, reductions, epilogues, inlined names): the blocks once the element-wise blocks that
    are not outputs are inlined; ColumnError unless they are column reductions of one shape and
    element-wise outputs reading one reduction each."""
    views = views_of(func, analyses)
    outputs = output_blocks(views, func)
    inlined = [v.name for v in views if v.name not in outputs and not v.has_reduction]
    _, kept = inline_trial(func, inlined, ColumnError, analyses)
    check_describable(kept, ColumnError)
    reductions = [v for v in kept if v.has_reduction]
    if not reductions:
        raise ColumnError("column-no-reduction")
    shapes = {_reduction_shape(v) for v in reductions}
    if len(shapes) != 1:
        raise ColumnError("column-shapes-differ")
    (spatial, reduced), = shapes
    if not _without_units(spatial) and reduced < WHOLE_TENSOR_MIN:
        raise ColumnError("column-whole-tensor-small", elements=reduced)
    for view in reductions:
        if len(view.writes) != 1:
            raise ColumnError("column-writes-several", block=view.name)
        if _without_units(spatial):
            _check_contiguous(view)
    written = {v.writes[0].buffer.name: v.name for v in reductions}
    epilogues = []
    for view in kept:
        if view.has_reduction:
            continue
        sources = {written[r.buffer.name] for r in view.reads if r.buffer.name in written}
        limit = static_product(spatial)
        small = all(r.buffer.name in written or (limit is not None and (static_product(r.buffer.shape) or 0) <= limit)
                    for r in view.reads)
        if (len(sources) != 1 or not small or len(view.writes) != 1
                or _without_units(static_int(e) for e in view.extents) != _without_units(spatial)):
            raise ColumnError("column-not-epilogue", block=view.name)
        epilogues.append((view.name, sources.pop()))
    return views, reductions, tuple(epilogues), tuple(inlined), outputs


def _without_units(extents) -> tuple:
    return tuple(e for e in extents if e != 1)


def _vector(columns: int, dtype_bytes: int, spec: TargetSpec) -> int:
    lanes = max(1, spec.vector_bytes // dtype_bytes)
    while columns % lanes:
        lanes //= 2
    return lanes


def _tile(columns: int, vector: int, dtype_bytes: int) -> int:
    """Columns per block: a power of two from `vector` up to a sector per row, dividing the columns."""
    tile = vector
    while tile * 2 * dtype_bytes <= SECTOR_BYTES and columns % (tile * 2) == 0:
        tile *= 2
    return tile


def _divisors(n: int) -> list:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _threads_y(rows: int, threads_x: int, registers, spec: TargetSpec) -> int:
    """Row threads per block: the largest divisor of the rows (no thread predicate inside the
    reduction) that keeps a block within the target's threads and its threads within the register
    budget of its size (`registers(rows per thread)`: no spills), each thread summing at least
    MIN_ROWS_PER_THREAD rows."""
    return max(d for d in _divisors(rows)
               if threads_x * d <= spec.max_threads_per_block and rows >= d * MIN_ROWS_PER_THREAD
               and registers(rows // d) <= register_budget(threads_x * d, spec) or d == 1)


def _block(columns: int, outer: int, rows: int, dtype_bytes: int, reductions: list, spec: TargetSpec) -> tuple:
    """(vector, tile, threads_x, threads_y): the widest vector, unless the register budget cuts its row
    threads; then the vector whose blocks launch the most threads (the wider on ties)."""
    loads = len({a.buffer.name for v in reductions for a in v.reads})  # one load per buffer and row
    vector, best = _vector(columns, dtype_bytes, spec), None
    while True:
        tile = _tile(columns, vector, dtype_bytes)
        tx = tile // vector
        ty = _threads_y(rows, tx, lambda per_thread, v=vector: column_split_registers(
            len(reductions), v, loads, per_thread), spec)
        threads = outer * columns // tile * tx * ty
        if best is None or threads > best[0]:
            best = (threads, vector, tile, tx, ty)
        if vector == 1 or ty == _threads_y(rows, tx, lambda per_thread: 0, spec):
            return best[1:]
        vector //= 2


def _split(tiles: int, rows: int, block: int, ty: int, spec: TargetSpec) -> int:
    """Row chunks over blocks: the fewest, dividing the rows, that reach `fill_threads` and the wanted
    blocks, each thread still summing at least MIN_ROWS_PER_THREAD rows (1 if none does)."""
    per_thread = rows // ty
    fitting = [s for s in _divisors(per_thread) if per_thread // s >= MIN_ROWS_PER_THREAD]
    return next((s for s in fitting if tiles * s * block >= fill_threads(spec) and tiles * s >= wanted_blocks(spec)),
                fitting[-1] if fitting else 1)


def plan_column_split(func: tirx.PrimFunc, spec: TargetSpec, name: str, combine_allowed: bool,
                      analyses: Analyses | None = None) -> StitchPlan:
    """The column-split plan; `combine_allowed`: the group may take a second (combine) launch, because
    the plan it replaces takes one too; `analyses`: views and trials shared with the other planners."""
    if spec.family != "cuda":
        raise ColumnError("column-cuda-only")
    views, reductions, epilogues, inlined, outputs = _kept(func, analyses)
    spatial, rows = _reduction_shape(reductions[0])
    kept = _without_units(spatial)  # unit axes (a keepdims axis moved last) hold no columns
    columns, outer = (kept[-1], static_product(kept[:-1]) or 1) if kept else (1, 1)
    dtype_bytes = max(max(8, a.buffer.dtype.bits) for v in reductions for a in v.reads + v.writes) // 8
    vector, tile, tx, ty = _block(columns, outer, rows, dtype_bytes, reductions, spec)
    if tx * ty < spec.warp_size:
        raise ColumnError("column-no-row-divisor", rows=rows)
    tiles = outer * columns // tile
    # A whole-tensor reduction this large has no other plan: the combine launch is its second.
    split = _split(tiles, rows, tx * ty, ty, spec) if combine_allowed or not kept else 1
    if not kept and not 1 < split <= spec.max_threads_per_block:
        raise ColumnError("column-no-chunks", elements=rows, most=spec.max_threads_per_block)
    mapping = ThreadMapping(rows=outer * columns, rows_per_task=ty, threads=tx, vector=vector,
                            grid=tiles * split, split=split)
    # TVM's cross-thread reduction over threadIdx.y stages one value per thread per reduction.
    staged = tuple(max(1, v.writes[0].buffer.dtype.bits // 8) * tx * ty for v in reductions)
    return StitchPlan(
        kernel=name,
        target="cuda",
        scheme="column-split",
        ops=tuple(v.name for v in views),
        dominant=tuple(v.name for v in reductions),
        rank=len(spatial),
        row_shape=tuple(str(e) for e in spatial),
        mapping=mapping,
        intermediates=_intermediates(views, inlined, reductions, epilogues, outputs, split),
        outputs=tuple(v.name for v in views if v.name in outputs),
        kernels=2 if split > 1 else 1,
        shared_bytes=cuda_shared_bytes(staged, (), tx * ty, 1, spec.warp_size),
        shared_rows=staged,
        reductions=len(reductions),
        notes=_notes(mapping, spatial, rows, tile, epilogues),
        spec=spec,
    )


def _intermediates(views: list, inlined: tuple, reductions: list, epilogues: tuple, outputs: set,
                   split: int) -> tuple:
    out = [Intermediate(name, REGISTER, 0, "element-wise producer: recomputed inside the reduction", inlined=True)
           for name in reversed(inlined)]
    fed = {source for _, source in epilogues}
    for view in reductions:
        nbytes = max(1, view.writes[0].buffer.dtype.bits // 8)
        if split > 1:
            out.append(Intermediate(f"{view.name}_rf", GLOBAL, split * nbytes,
                                    f"{split} row-chunk partials per column, combined in kernel 1"))
        if view.name in fed and view.name not in outputs:
            out.append(Intermediate(view.name, REGISTER, nbytes, "combined value, read by its epilogue "
                                    "in the thread that combines it"))
    return tuple(out)


def _notes(mapping: ThreadMapping, spatial: tuple, rows: int, tile: int, epilogues: tuple) -> tuple:
    m = mapping
    block = m.threads * m.rows_per_task
    notes = [f"column reductions of {rows} rows over {'x'.join(map(str, spatial))} kept elements: blocks of "
             f"{m.threads} x {m.rows_per_task} threads (columns x rows), {tile} columns per block, "
             f"{m.vector}-element accesses, {m.grid} blocks ({m.grid * block} threads)"]
    if m.split > 1:
        notes.append(f"rows cut into {m.split} chunks over blocks: partials in global memory, combined per "
                     "column in a second kernel (no counter in the same launch: TVM's workspace is "
                     "uninitialised, and no grid barrier without a cooperative launch)")
    else:
        notes.append("one launch: each block combines its row threads' sums in shared memory")
    if epilogues:
        notes.append("element-wise outputs of the reductions computed by the thread that writes each result: "
                     + ", ".join(name for name, _ in epilogues))
    return tuple(notes)
