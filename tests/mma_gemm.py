"""A small GEMM tensorized with TVM's mma intrinsics (ldmatrix, mma.sync m16n8k16, mma_fill, mma_store),
scheduled as a CUDA kernel: blocks of 2 x 2 warps, one 16 x 16 output tile per warp, K staged through
shared memory in steps of 32. Test material for the SIMT checker's tensor-core emulation."""

from __future__ import annotations

import tvm
from tvm import s_tir, te
from tvm.s_tir.tensor_intrin import cuda as intrinsics

from tir_text import reparsed

TILE = 16
WARPS = (2, 2)  # warps along M and N per block
K_STEPS = 2  # 16-deep mma steps per shared-memory stage


def gemm(m: int, n: int, k: int, b_transposed: bool, dtype: str = "float16", out_dtype: str = "float32"):
    """C[m, n] = A[m, k] B[k, n] (B given as [n, k] when `b_transposed`), products in `out_dtype`."""
    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k) if b_transposed else (k, n), dtype, name="B")
    r = te.reduce_axis((0, k), "r")

    def product(i, j):
        right = b[j, r] if b_transposed else b[r, j]
        return te.sum(a[i, r].astype(out_dtype) * right.astype(out_dtype), axis=r)

    return te.create_prim_func([a, b, te.compute((m, n), product, name="C")])


def _stage_to_shared(sch, block, index: int, stage_loop) -> None:
    read = sch.cache_read(block, index, "shared")
    sch.compute_at(read, stage_loop)
    fused = sch.fuse(*sch.get_loops(read)[-2:])
    _, ty, tx, vec = sch.split(fused, factors=[None, WARPS[0] * WARPS[1], 32, 4])
    sch.bind(tx, "threadIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.vectorize(vec)
    sch.storage_align(read, 0, axis=-2, factor=32, offset=8)


def _tile(sch, block):
    rows, cols = sch.get_loops(block)[-2:]
    r0, r1 = sch.split(rows, factors=[None, TILE])
    c0, c1 = sch.split(cols, factors=[None, TILE])
    sch.reorder(r0, c0, r1, c1)
    return r1


def tensorized(func, b_transposed: bool, out_dtype: str = "float32"):
    """`gemm`'s PrimFunc scheduled with TVM's mma intrinsic group (needs a tvm-ffi whose Tensorize works)."""
    group = intrinsics.get_mma_intrin_group("shared", "global", "float16", out_dtype, False, b_transposed,
                                            not_use_mma_store_intrinic=False)
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("C")
    i, j, k = sch.get_loops(block)
    i, i_tile = sch.split(i, factors=[None, TILE])
    j, j_tile = sch.split(j, factors=[None, TILE])
    k, k_tile = sch.split(k, factors=[None, TILE])
    sch.reorder(i, j, k, i_tile, j_tile, k_tile)
    outer = sch.blockize(i_tile)
    i0, i1 = sch.split(i, factors=[None, WARPS[0]])
    j0, j1 = sch.split(j, factors=[None, WARPS[1]])
    k0, k1 = sch.split(k, factors=[None, K_STEPS])
    sch.reorder(i0, j0, i1, j1, k0, k1)
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")
    _stage_to_shared(sch, outer, 0, k0)
    _stage_to_shared(sch, outer, 1, k0)
    a_warp = sch.cache_read(outer, 0, "warp")
    b_warp = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_warp, k1)
    sch.compute_at(b_warp, k1)
    c_warp = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_warp, warp)
    c_loop = _tile(sch, c_warp)
    sch.decompose_reduction(outer, sch.get_loops(outer)[2])
    a_loop, b_loop = _tile(sch, a_warp), _tile(sch, b_warp)
    layout = intrinsics.shared_16x16_to_ldmatrix_32x8_layout
    for stage, buffer in ((a_warp, ("write", 0)), (b_warp, ("write", 0)), (c_warp, ("read", 0))):
        sch.transform_layout(stage, buffer, lambda r, c: (r // TILE, c // TILE, *layout(r % TILE, c % TILE)))
    sch.tensorize(a_loop, group["load_a"])
    sch.tensorize(b_loop, group["load_b"])
    sch.tensorize(sch.get_loops(block)[-3], group["compute"])
    sch.tensorize(sch.get_loops(sch.get_sblock("C_init"))[-2], group["init"])
    sch.tensorize(sch.get_loops(c_warp)[-2], group["store"])
    return sch.mod["main"]


def as_bfloat16(func):
    """A float16 tensorized GEMM made bfloat16 (TVM 0.27 registers no bfloat16 mma intrinsic): every
    float16 buffer bfloat16 and the mma's multiplicands .bf16, as a bfloat16 kernel calls them."""
    return reparsed(func.script().replace('"float16"', '"bfloat16"').replace('"fp16"', '"bf16"'))
