"""Half-precision GEMMs on tensor cores: warp-level mma.sync m16n8k16, float32 accumulation.

dlight 0.27's `Matmul` rule hands a GEMM to its tensor-core path only for
float16 inputs and only when every static M, N and K exceeds 64; bfloat16
GEMMs and small float16 ones (attention heads of 64, short sequences) run
on the SIMT cores. This rule takes a GEMM (dlight's normal form
`C[S, I, J] += A[S, I, K] * B[S, J, K]`, any batch and any layout of the
operands, epilogues and prologues inlined as dlight does) whose operands
are float16 or bfloat16 and whose accumulator is float32 (the importer's
products: `matmul(..., out_dtype="float32")` then a cast), on an arch
whose `TargetSpec.mma_dtypes` holds the dtype (sm_80 and later), and
schedules it with the intrinsics of schedules/mma_intrinsics.py:

- a block tile of `warps` x `fragments` x 16 rows and columns (at most
  128 x 64, 4 warps), shrunk to the GEMM's extents rounded up to 16, so an
  extent of 64 or less runs one block of the fitting size;
- the operands staged through shared memory (rows padded by 8 elements:
  ldmatrix's 8 row addresses fall in different banks), ldmatrix into
  fragments, two mma.sync per 16x16x16 step;
- the accumulator through shared memory to global memory, the epilogue
  (the cast to the model's dtype, a bias, an activation) inlined there.

Extents that are not multiples of the tile are padded (`pad_einsum`).
`kernel` gives the scheduled PrimFunc, compiled under
`__launch_bounds__(threads, 1)`: under `__launch_bounds__(128)` alone ptxas
for sm_90 traded registers for occupancy and spilled 8-24 bytes at 72-128
registers (GPT-2's and BERT's float16 projections at bench size; none with
the minimum of one block per SM, at 86 registers for the 72 of before).
`apply` returns None where the function is not such a GEMM, the dtype or
arch does not fit, or the tensorization does not match.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                         get_reduction_blocks)

from schedules import mma_intrinsics as mma
from schedules import mma_tf32_intrinsics as tf32
from schedules.tensorize_guard import NO_TENSORIZE, tensorize_faults
from tvm_stitch.analysis.tir_view import substitute
from tvm_stitch.planning.spec import TargetSpec

MAX_WARPS = (2, 2)  # warps along I and J
MAX_FRAGMENTS = (4, 2)  # 16x16 accumulator tiles per warp along I and J
K_STEPS = 2  # 16-deep steps per shared-memory stage
DEEP_K_STEPS = 4  # where K is a multiple of 64
PAD_BYTES = 16  # added to each shared row: ldmatrix's 8 row addresses fall in different banks
STORE_VECTOR = 4  # accumulator elements per thread and store (16 bytes of float32)
ACCUMULATOR_BYTES = 4  # float32
MIN_BLOCKS_PER_SM = 1  # __launch_bounds__(threads, 1): else ptxas trades registers for occupancy and spills


@dataclass(frozen=True)
class Tile:
    """Warps and 16x16 fragments per warp along I and J, and 16-deep steps per stage along K."""

    warps: tuple
    fragments: tuple
    k_steps: int

    def rows(self, axis: int) -> int:
        return self.warps[axis] * self.fragments[axis] * mma.TILE

    def shared_bytes(self, dtype_bytes: int) -> int:
        depth = self.k_steps * mma.TILE + _pad(dtype_bytes)
        operands = (self.rows(0) + self.rows(1)) * depth * dtype_bytes
        return max(operands, self.rows(0) * (self.rows(1) + _pad(ACCUMULATOR_BYTES)) * ACCUMULATOR_BYTES)


def _pad(dtype_bytes: int) -> int:
    """Elements added to each shared row of `dtype_bytes`-byte elements."""
    return PAD_BYTES // dtype_bytes


def intrinsics(dtype: str):
    """The intrinsic module of an operand dtype: mma_intrinsics (float16, bfloat16) or, for float32,
    mma_tf32_intrinsics; both name their intrinsics and fragment layouts alike."""
    return tf32 if dtype == tf32.DTYPE else mma


def _split_extent(extent, warps: int, fragments: int) -> tuple:
    """(warps, fragments) covering `extent` (None: symbolic) with the least padding."""
    if extent is None:
        return warps, fragments
    tiles = -(-extent // mma.TILE)
    if tiles >= warps * fragments:
        return warps, fragments
    use_warps = warps if tiles % warps == 0 else 1
    return use_warps, -(-tiles // use_warps)


def _divides(extent, warps: int, fragments: int) -> bool:
    return extent is None or extent % (warps * fragments * mma.TILE) == 0


def _fill(extents: tuple, warps: tuple, fragments: tuple, batch: int, sms: int) -> tuple:
    """Fragments per warp along I and J, halved where the halved tile divides an extent the tile does
    not (no padding, vector copies), then, the larger first, while the halved tile's grid has at most one
    block per SM (a small GEMM on a few large blocks leaves most SMs idle, each block a long K loop)."""
    fragments = list(fragments)
    for axis in (0, 1):
        while (fragments[axis] % 2 == 0 and not _divides(extents[axis], warps[axis], fragments[axis])
               and _divides(extents[axis], warps[axis], fragments[axis] // 2)):
            fragments[axis] //= 2

    def blocks() -> int:
        rows = [-(-e // (w * f * mma.TILE)) if e is not None else sms for e, w, f in zip(extents, warps, fragments)]
        return batch * rows[0] * rows[1]

    while 2 * blocks() <= sms:
        axis = 0 if fragments[0] >= fragments[1] else 1
        if fragments[axis] % 2:
            axis = 1 - axis
        if fragments[axis] % 2:
            break
        fragments[axis] //= 2
    return tuple(fragments)


def choose_tile(extents: tuple, spec: TargetSpec, dtype_bytes: int, batch: int = 1) -> Tile | None:
    """The tile for static (I, J, K) extents (None where symbolic) and `batch` GEMMs, within the block's
    shared memory: at most 128 x 64, fitted to extents of 64 or less, smaller where that avoids padding
    or gives every SM a block (_fill); 64 deep per stage where K is a multiple of 64 (half the stages,
    half the barriers), else 32 (16 for K of 16 or less)."""
    i, j, k = extents
    wi, fi = _split_extent(i, MAX_WARPS[0], MAX_FRAGMENTS[0])
    wj, fj = _split_extent(j, MAX_WARPS[1], MAX_FRAGMENTS[1])
    fragments = _fill(extents, (wi, wj), (fi, fj), batch, spec.sms)
    if k is None or k % (DEEP_K_STEPS * mma.TILE) == 0:
        k_steps = DEEP_K_STEPS
    else:
        k_steps = K_STEPS if k > mma.TILE else 1
    tile = Tile((wi, wj), fragments, k_steps)
    return tile if tile.shared_bytes(dtype_bytes) <= spec.shared_bytes_per_block else None


def _operand_dtype(block: tirx.SBlock, spec: TargetSpec, allow_tf32: bool) -> str | None:
    """The operands' dtype where the accumulator is float32 and the arch's mma takes them: float16 and
    bfloat16 (m16n8k16), float32 on TF32 tensor cores (m16n8k8) only with `allow_tf32`."""
    dtypes = {str(region.source.dtype) for region in block.reads}
    out = str(block.writes[0].source.dtype)
    if len(dtypes) != 1 or out != "float32":
        return None
    (dtype,) = dtypes
    if dtype == tf32.DTYPE:
        return dtype if allow_tf32 and spec.mma_tf32 else None
    return dtype if dtype in mma.DTYPES and dtype in spec.mma_dtypes else None


def _static(extent) -> int | None:
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _normalise(sch: s_tir.Schedule, main) -> bool:
    """dlight's normal form C[S, I, J] += A[S, I, K] * B[S, J, K]; False where the block is no GEMM."""
    if get_index_map(sch.get(main)) is None:
        return False
    reindex = [sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)), sch.reindex(main, ("write", 0))]
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(reindex[0], ("write", 0), a_map)
    sch.transform_layout(reindex[1], ("write", 0), b_map)
    sch.transform_layout(reindex[2], ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    return True


def _vector_along(block: tirx.SBlock, access, axis: int, vector: int) -> bool:
    """Whether `access` of `block` (one element per block iteration) reads or writes `vector`
    consecutive elements of its buffer's last axis, starting on a `vector`-element boundary, as the
    block's iteration variable `axis` runs through each aligned run of `vector` values, its other
    indices fixed over the run: a vector access is aligned. The iteration variables range over their
    domains, so an index that wraps (a reshape's `k % 512` inlined) is read within them."""
    extent = block.iter_vars[axis].dom.extent
    last = access.source.shape[-1]
    if not all(isinstance(e, tirx.IntImm) and int(e) % vector == 0 for e in (extent, last)):
        return False
    var = block.iter_vars[axis].var
    analyzer = sym.Analyzer()
    for k, iv in enumerate(block.iter_vars):
        if k != axis:
            analyzer.bind(iv.var, iv.dom)
    run, lane = tirx.Var("run", var.ty), tirx.Var("lane", var.ty)
    analyzer.bind(run, tvm.ir.Range(0, int(extent) // vector))
    analyzer.bind(lane, tvm.ir.Range(0, vector))
    start = run * vector
    indices = [region.min for region in access.region]
    moved = [analyzer.simplify(substitute(i, {var: start + lane}) - substitute(i, {var: start})) for i in indices]
    first = analyzer.simplify(tirx.floormod(substitute(indices[-1], {var: start}), vector))
    return (all(analyzer.can_prove_equal(m, 0) for m in moved[:-1]) and analyzer.can_prove_equal(moved[-1], lane)
            and analyzer.can_prove_equal(first, 0))


def _layout(sch: s_tir.Schedule, copy, vector: int, padded: bool, transposable: bool) -> tuple:
    """(stored [k, rows] in shared memory, vector width) of an operand's copy: K-major where its
    source runs along K, [k, rows] where it runs along the rows (a transposed operand) and the
    intrinsics load such a tile, vectors only where the source is aligned and unpadded."""
    block = sch.get(copy)
    if padded or len(block.reads) != 1:
        return False, 1
    (access,) = block.reads
    rows, depth = len(block.iter_vars) - 2, len(block.iter_vars) - 1
    if _vector_along(block, access, depth, vector):
        return False, vector
    if transposable and _vector_along(block, access, rows, vector):
        return True, vector
    return False, 1


def _fetch_to_shared(sch: s_tir.Schedule, block, index: int, at, threads: tuple, vector: int, padded: bool,
                     dtype: str):
    """Operand `index` of `block` staged in shared memory at loop `at` (its producers, casts and
    transposes, inlined into the copy), copied by every thread; returns whether it is stored [k, rows]."""
    copy = sch.cache_read(block, index, mma.SHARED)
    sch.compute_at(copy, at)
    auto_inline_producers(sch, copy)
    trans, width = _layout(sch, copy, vector, padded, intrinsics(dtype).TRANSPOSABLE)
    loops = sch.get_loops(copy)[-2:]
    if trans:
        sch.transform_layout(copy, ("write", 0), lambda b, r, k: (b, k, r))
        sch.reorder(loops[1], loops[0])
    fused = sch.fuse(*sch.get_loops(copy)[-2:])
    _, ty, tx, vec = sch.split(fused, [None, threads[0], threads[1], width])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.storage_align(copy, 0, axis=-2, factor=32, offset=_pad(tvm.DataType(dtype).bits // 8))
    return trans


def _fragment_loop(sch: s_tir.Schedule, block, read: bool):
    """The 16x16 inner loops of a copy between shared memory and fragments; returns the outer of them."""
    i, j = sch.get_loops(block)[-2:]
    i0, i1 = sch.split(i, [None, mma.TILE])
    j0, j1 = sch.split(j, [None, mma.TILE])
    sch.reorder(i0, j0, i1, j1)
    if read:
        sch.unroll(i0)
        sch.unroll(j0)
    return i1


def _fragment_map(index, trans: bool = False):
    """A [batch, rows, columns] fragment buffer (with `trans`: [batch, columns, rows]) as [batch, row
    tile, column tile, lane, element]."""
    if trans:
        return lambda s, j, i: (s, i // mma.TILE, j // mma.TILE, *index(i % mma.TILE, j % mma.TILE))
    return lambda s, i, j: (s, i // mma.TILE, j // mma.TILE, *index(i % mma.TILE, j % mma.TILE))


def _loops(sch: s_tir.Schedule, main, tile: Tile) -> dict:
    """Split the normal form's loops into grid, warps, stages and 16x16x16 steps; bind grid and warps."""
    batch, i, j, k = sch.get_loops(main)
    i, i_tc = sch.split(i, [None, mma.TILE])
    j, j_tc = sch.split(j, [None, mma.TILE])
    k, k_tc = sch.split(k, [None, mma.TILE])
    sch.reorder(i, j, k, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    i0, i1, i2 = sch.split(i, [None, tile.warps[0], tile.fragments[0]])
    j0, j1, j2 = sch.split(j, [None, tile.warps[1], tile.fragments[1]])
    k0, k1 = sch.split(k, [None, tile.k_steps])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(batch, "blockIdx.z")
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")
    return {"outer": outer, "warp": warp, "stage": k0, "step": k1}


def _tensorize(sch: s_tir.Schedule, main, loops: dict, tile: Tile, dtype: str, spec: TargetSpec,
               padded: tuple) -> None:
    outer, warp = loops["outer"], loops["warp"]
    threads = (tile.warps[0] * tile.warps[1], spec.warp_size)
    vector = spec.vector_bytes // (tvm.DataType(dtype).bits // 8)
    trans_a = _fetch_to_shared(sch, outer, 0, loops["stage"], threads, vector, padded[0] or padded[2], dtype)
    trans_b = _fetch_to_shared(sch, outer, 1, loops["stage"], threads, vector, padded[1] or padded[2], dtype)
    a_warp = sch.cache_read(outer, 0, "warp")
    b_warp = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_warp, loops["step"])
    sch.compute_at(b_warp, loops["step"])
    c_shared = sch.cache_write(outer, 0, mma.SHARED)
    c_warp = sch.cache_write(outer, 0, "warp")
    sch.storage_align(c_warp, 0, axis=-2, factor=32, offset=_pad(ACCUMULATOR_BYTES))
    sch.reverse_compute_at(c_warp, warp)
    sch.reverse_compute_at(c_shared, warp)
    init = sch.decompose_reduction(outer, loops["stage"])
    a_loop = _fragment_loop(sch, a_warp, True)
    b_loop = _fragment_loop(sch, b_warp, True)
    c_loop = _fragment_loop(sch, c_warp, False)
    unit = intrinsics(dtype)
    sch.transform_layout(a_warp, ("write", 0), _fragment_map(unit.fragment_index_a, trans_a))
    sch.transform_layout(b_warp, ("write", 0), _fragment_map(unit.fragment_index_b, trans_b))
    sch.transform_layout(c_warp, ("read", 0), _fragment_map(mma.fragment_index))
    sch.tensorize(a_loop, unit.ldmatrix_name(dtype, "a", trans_a))
    sch.tensorize(b_loop, unit.ldmatrix_name(dtype, "b", trans_b))
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], mma.FILL)
    sch.tensorize(sch.get_loops(main)[-3], unit.mma_name(dtype))
    sch.tensorize(c_loop, mma.STORE_SHARED)
    _store(sch, c_shared, spec, padded[0] or padded[1])


def _store(sch: s_tir.Schedule, c_shared, spec: TargetSpec, padded: bool) -> None:
    """The accumulator from shared to global memory with the epilogue inlined, in vectors where the
    output is written contiguously and unpadded."""
    auto_inline_consumer_chain(sch, c_shared)
    block = sch.get(c_shared)
    aligned = not padded and len(block.writes) == 1 and _vector_along(block, block.writes[0],
                                                                      len(block.iter_vars) - 1, STORE_VECTOR)
    _, tx, vec = sch.split(sch.fuse(*sch.get_loops(c_shared)[-2:]),
                           [None, spec.warp_size, STORE_VECTOR if aligned else 1])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


def apply(func: tirx.PrimFunc, spec: TargetSpec, allow_tf32: bool = False,
          tile: Tile | None = None) -> s_tir.Schedule | None:
    """A tensor-core schedule of a float16/bfloat16 GEMM with a float32 accumulator (with `allow_tf32`,
    of a float32 GEMM on TF32 tensor cores as well); None otherwise. `tile`: the block tile (default:
    choose_tile's for the GEMM's extents)."""
    if spec.family != "cuda" or tensorize_faults() or (func.attrs is not None and NO_TENSORIZE in func.attrs):
        return None
    sch = s_tir.Schedule(func)
    blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if blocks is None:
        return None
    (main,) = blocks
    dtype = _operand_dtype(sch.get(main), spec, allow_tf32)
    if dtype is None or not _normalise(sch, main):
        return None
    batch, *extents = (_static(iv.dom.extent) for iv in sch.get(main).iter_vars)
    extents = tuple(extents)
    if tile is None:
        tile = choose_tile(extents, spec, tvm.DataType(dtype).bits // 8, batch if batch is not None else spec.sms)
    if tile is None:
        return None
    steps = (tile.rows(0), tile.rows(1), tile.k_steps * mma.TILE)
    padded = tuple(extent is None or extent % step != 0 for extent, step in zip(extents, steps))
    sch.pad_einsum(main, [1, *steps])
    intrinsics(dtype).register()
    _tensorize(sch, main, _loops(sch, main, tile), tile, dtype, spec, padded)
    return sch if _every_block_on_the_grid(sch) else None


def _every_block_on_the_grid(sch: s_tir.Schedule) -> bool:
    """Whether every block runs under a thread-bound loop: a producer that could not be inlined into the
    operand copies would stay a loop nest of its own, which no GPU build takes."""
    return all(any(sch.get(loop).kind == tirx.ForKind.THREAD_BINDING for loop in sch.get_loops(block))
               for block in sch.get_child_blocks(get_root_block(sch)))


def kernel(sch: s_tir.Schedule) -> tirx.PrimFunc:
    """The PrimFunc of an `apply` schedule, its kernel compiled under `__launch_bounds__(threads,
    MIN_BLOCKS_PER_SM)` (the attribute TVM's CUDA code generator reads, inside the block loop)."""

    def bounded(loop, mutator):
        loop = mutator.default_mutate(loop)
        if loop.thread_binding is None or str(loop.thread_binding.thread_tag) != "blockIdx.x":
            return loop
        body = tirx.AttrStmt(tirx.IntImm("int32", 0), "tirx.launch_bounds_min_blocks_per_sm",
                             tirx.IntImm("int32", MIN_BLOCKS_PER_SM), loop.body)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                        loop.annotations)

    func = sch.mod["main"]
    return func.with_body(tvm_ffi.structural_mutate(func.body, [(tirx.For, bounded)]))
