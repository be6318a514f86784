"""Compute-intensive PrimFuncs on the CPU: matmuls and convolutions with their fused epilogues.

The dlight-like contract: `apply(func, target)` returns a schedule, or None
when the function is not one this rule handles. It takes a function with one
reduction block that multiplies two operands (dense or batched matmul,
depthwise or pointwise convolution), element-wise or injective producers
(padding) and consumers (bias, GELU, residual, transposes), where the
innermost output axis walks every operand contiguously (or not at all): a
strided convolution's input would be gathered, and was slower than TVM's
loop nest.

The reduction is register-blocked: its last two spatial axes (rows i and
columns j of a matmul; output rows and columns of a convolution) are cut into
a tile of `rows x cols` accumulators, `cols` a multiple of the vector width,
which stay in vector registers over the whole reduction: per reduction step
one vector load of the second operand per vector of the tile and one
broadcast of the first per row (a convolution holds no vectors of its
weight, which it broadcasts, and gives those registers to accumulators).
Tiles are walked columns-outer so one column panel of the second operand
(a matmul's weights) is reused, from the caches, by every row tile, or
rows-outer where all the panels fit in half the L2 and the first operand
does not (each row tile then stays in L1 over every panel); a single long
reduction axis is cut into chunks so a panel chunk stays in L1. The tile loops and any batch axes are
fused into one loop, parallel over the cores. The consumers are computed per
tile right after it (the intermediate shrinks to the tile), vectorised; the
producers run before, as their own parallel, vectorised loops.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target

from tvm_stitch.analysis.tir_view import vars_in
from tvm_stitch.planning.spec import TargetSpec

MAX_TILE_ROWS = 8  # rows of the accumulator tile at most (each row is unrolled)
MIN_TILE_ROWS = 4  # rows a tile keeps when it widens: 4 broadcasts reuse each loaded vector


def _static(sch: s_tir.Schedule, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _largest_divisor(extent: int, limit: int) -> int:
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def _is_reduction(block: s_tir.SBlock) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


def _multiplies_two_operands(block: s_tir.SBlock) -> bool:
    """C[...] = C[...] + (A[...] * B[...]), possibly with casts: a contraction, not a plain sum."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add) or block.init is None:
        return False
    terms = [store.value.a, store.value.b]
    accumulated = [t for t in terms if isinstance(t, tvm.ir.TensorLoad) and t.source.same_as(store.buffer)]
    if len(accumulated) != 1:
        return False
    product = next(t for t in terms if t is not accumulated[0])
    while isinstance(product, tirx.Cast):
        product = product.value
    return isinstance(product, tirx.Mul) and len({r.source for r in block.reads} - {store.buffer}) == 2


def _stride(expr, var) -> int | None:
    """How far `expr` moves when `var` grows by one (0: it does not use it); None if not affine."""
    if not any(v.same_as(var) for v in vars_in(expr)):
        return 0
    coefficients = sym.detect_linear_equation(expr, [var])
    if len(coefficients) != 2 or not isinstance(coefficients[0], tirx.IntImm):
        return None
    return int(coefficients[0].value)


def _contiguous_along(block: s_tir.SBlock, var) -> bool:
    """Every access of the block moves by one element or not at all along `var`, in its last
    dimension only, and the output moves: vectors along `var` are plain loads and stores, no
    gathers (a strided convolution's input along its output columns is one)."""
    for region in list(block.reads) + list(block.writes):
        mins = [r.min for r in region.region]
        if any(_stride(m, var) != 0 for m in mins[:-1]) or (mins and _stride(mins[-1], var) not in (0, 1)):
            return False
    return all(r.region and _stride(r.region[-1].min, var) == 1 for r in block.writes)


def _lanes(columns: int | None, lanes: int) -> int:
    """Vector lanes for `columns` output columns: the target's, or where they do not divide a
    static column count the widest power of two (at least 4) that does: 56 columns (ConvNeXt's
    56 x 56 images) are 7 vectors of 8 lanes, not a 14-lane vector LLVM cuts into pieces."""
    if columns is None or columns % lanes == 0:
        return lanes
    narrower = lanes
    while narrower > 4 and columns % narrower:
        narrower //= 2
    return narrower if columns % narrower == 0 else lanes


def _column_vectors(columns: int | None, lanes: int, registers: int, held: int = 1) -> int:
    """Vectors of columns per tile. All the columns when they are whole vectors that leave room
    for MIN_TILE_ROWS rows of accumulators plus `held` registers per vector of the second
    operand and one for the broadcast (AVX-512's 32 registers: up to 6 vectors, 96 columns, for
    a matmul; 7 where no operand is held per column vector, as a convolution's input, loaded per
    row and vector, and its weight, broadcast): the first operand is then read once. Otherwise
    two vectors where they divide the axis, else one: a wider panel than two vectors streams
    from L2 at half the FMAs per byte of the 8 x 2 tile, which lost to it on long reductions
    (512 x 1536 x 384: 0.74x)."""
    if columns is None or columns % lanes:
        return 1
    if columns // lanes <= max(1, (registers - 1) // (MIN_TILE_ROWS + held)):
        return columns // lanes
    return 2 if columns % (2 * lanes) == 0 else 1


def _tile(columns: int | None, rows: int | None, lanes: int, registers: int, held: int = 1) -> tuple[int, int]:
    """(tile rows, tile columns): the vectors of columns `_column_vectors` picks (the largest
    divisor below one vector where no vector divides; one vector of a symbolic count), and as
    many rows as the registers left after `held` per vector and a broadcast hold, at most
    MAX_TILE_ROWS (a divisor of a static row count; of a symbolic count the last tile of
    either is cut short by a predicate)."""
    vectors = _column_vectors(columns, lanes, registers, held)
    if columns is not None and columns % lanes:
        cols = _largest_divisor(columns, lanes)
    else:
        cols = vectors * lanes
    limit = min(MAX_TILE_ROWS, max(1, (registers - held * vectors - 1) // vectors))
    return (limit if rows is None else _largest_divisor(rows, limit)), cols


def _held_per_vector(block: s_tir.SBlock, row_var, column_var) -> int:
    """1 when an operand moves along the columns but not the rows (a matmul's weights: its
    vectors are loaded once per reduction step and held for every row of the tile), else 0 (a
    convolution: the input moves along both, loaded per row and vector; the weight along
    neither, broadcast)."""
    accumulator = block.writes[0].source if block.writes else None
    for region in block.reads:
        if accumulator is not None and region.source.same_as(accumulator):
            continue
        mins = [r.min for r in region.region]
        if any(_stride(m, column_var) != 0 for m in mins) and all(_stride(m, row_var) == 0 for m in mins):
            return 1
    return 0


def _rows_outer(sch: s_tir.Schedule, reduce: list, rows, columns, cols: int, elem_bytes: int,
                l2_bytes: int) -> bool:
    """Walk the tiles rows-outer (each row tile over every column panel) when there is more than
    one panel, the panels together (reduction steps x columns) fit in half the L2 and the first
    operand's rows (rows x reduction steps) do not: its rows are then read once, from L1, and
    the second operand is reused from L2, where columns-outer re-reads all of the first operand
    from memory per panel (ConvNeXt's 6272 x 96 x 384: 12 passes over 2.4 MB). Symbolic
    extents keep columns-outer."""
    steps = [_static(sch, loop) for loop in reduce]
    if columns is None or rows is None or columns <= cols or any(s is None for s in steps):
        return False
    reduction = elem_bytes
    for s in steps:
        reduction *= s
    return 2 * reduction * columns <= l2_bytes < 2 * reduction * rows


def _vectorise_inner(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorise a block's innermost loop (split by the lanes when a multiple of them). A loop
    the vectoriser refuses stays serial."""
    loops = sch.get_loops(block)
    if not loops:
        return
    extent = _static(sch, loops[-1])
    if extent is None or extent == 1:
        return
    inner = loops[-1]
    if extent > lanes and extent % lanes == 0:
        _, inner = sch.split(inner, [None, lanes])
    try:
        sch.vectorize(inner)
    except s_tir.ScheduleError:
        pass


def _schedule_at_root(sch: s_tir.Schedule, block, lanes: int) -> None:
    """A block left outside the tile loop (padding, an epilogue that could not follow the tile):
    its outer loops fused and parallel, its innermost loop vectorised."""
    loops = sch.get_loops(block)
    if len(loops) > 1:
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
    _vectorise_inner(sch, block, lanes)


def apply(func: tirx.PrimFunc, target: Target, spec: TargetSpec) -> s_tir.Schedule | None:
    """A register-blocked, parallel, vectorised schedule of a contraction and its epilogue; None
    when `func` is not a single contraction with element-wise or injective neighbours, its
    innermost output axis is not contiguous in its operands. Rows, columns, batch axes and the
    reduction may be symbolic (rows = batch x sequence, attention scores' columns = sequence).
    `spec`: the target's TargetSpec (vector width and registers)."""
    if target.kind.name != "llvm":
        return None
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(get_root_block(sch))
    nodes = [sch.get(b) for b in blocks]
    reductions = [i for i, n in enumerate(nodes) if _is_reduction(n)]
    if len(reductions) != 1 or not _multiplies_two_operands(nodes[reductions[0]]):
        return None
    position = reductions[0]
    main = blocks[position]
    node = nodes[position]
    loops = sch.get_loops(main)
    if len(loops) != len(node.iter_vars):
        return None
    kinds = [iv.iter_type for iv in node.iter_vars]
    spatial = [l for l, k in zip(loops, kinds) if k == tirx.IterVar.DataPar]
    reduce = [l for l, k in zip(loops, kinds) if k == tirx.IterVar.CommReduce]
    if len(spatial) + len(reduce) != len(loops) or len(spatial) < 2:
        return None
    spatial_vars = [iv.var for iv in node.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if not _contiguous_along(node, spatial_vars[-1]):
        return None  # TVM's loop nest beat gathered vectors (a patchifying stem is a matmul before: patchify.py)
    out_bits = node.writes[0].source.dtype.bits if node.writes else 32
    columns = _static(sch, spatial[-1])
    lanes = _lanes(columns, max(1, spec.vector_bytes * 8 // max(32, out_bits)))
    held = _held_per_vector(node, spatial_vars[-2], spatial_vars[-1])
    row_count = _static(sch, spatial[-2])
    rows, cols = _tile(columns, row_count, lanes, spec.vector_registers, held)
    rows_outer = _rows_outer(sch, reduce, row_count, columns, cols, out_bits // 8, spec.l2_bytes)
    batch = spatial[:-2]
    i0, i1 = sch.split(spatial[-2], [None, rows])
    j0, j1 = sch.split(spatial[-1], [None, cols])
    chunk = spec.l1_bytes // max(1, cols * out_bits // 8)  # reduction steps whose panel rows fill L1
    if len(reduce) == 1 and chunk and (_static(sch, reduce[0]) or 0) > chunk:
        reduce = list(sch.split(reduce[0], [None, _largest_divisor(_static(sch, reduce[0]), chunk)]))
    sch.reorder(*batch, *((i0, j0) if rows_outer else (j0, i0)), *reduce, i1, j1)
    tile = j0 if rows_outer else i0

    consumers = blocks[position + 1:]
    consumer_names = {n.name_hint for n in nodes[position + 1:]}
    for block in consumers[:-1]:
        try:
            sch.compute_inline(block)
        except s_tir.ScheduleError:
            pass
    remaining = sch.get_child_blocks(get_root_block(sch))
    after = [b for b in remaining if sch.get(b).name_hint in consumer_names]
    attached = None
    if after:
        try:
            sch.reverse_compute_at(after[-1], tile, preserve_unit_loops=True)
            attached = after[-1]
            after = after[:-1]
        except s_tir.ScheduleError:
            pass
    sch.parallel(sch.fuse(*batch, *((i0, j0) if rows_outer else (j0, i0))))
    sch.unroll(i1)
    if cols > lanes and cols % lanes == 0:
        jv, j1 = sch.split(j1, [None, lanes])
        sch.unroll(jv)
    sch.vectorize(j1)
    init = sch.decompose_reduction(main, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])
    if attached is not None:
        _vectorise_inner(sch, attached, lanes)
    for block in after + list(blocks[:position]):
        _schedule_at_root(sch, block, lanes)
    return sch
