"""Warp-level TF32 tensor-core intrinsics for float32 GEMMs: ldmatrix of 32-bit elements, mma.sync m16n8k8.

PTX has `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32` from sm_80
(PTX ISA, "Warp-level matrix multiply-accumulate instructions"): float32
operands multiplied with TF32's 10-bit mantissa, float32 accumulators. The
tensor cores read an operand register's top 19 bits; the low mantissa bits
of a float32 are dropped (truncation, as with `allow_tf32` elsewhere).

The warp tile is the 16x16 one of schedules/mma_intrinsics.py, so the
float32 fill and store of the accumulator (`mma_intrinsics.FILL`,
`STORE_SHARED`) and the accumulator layout
(`mma_intrinsics.fragment_index`: that of m16n8k8's C as well) are shared:

- `ldmatrix_name("float32", "a")` / `"b"`: a K-major 16x16 float32 tile of
  shared memory into the warp's fragment by two `ldmatrix.sync.aligned.m8n8.x4.b16`.
  An 8x8 matrix of 16-bit elements is an 8x4 one of 32-bit elements, and
  ldmatrix hands lane l the element (l / 4, l % 4) of each: the layout of
  m16n8k8's TF32 A and B operands (PTX ISA, "Matrix fragments for
  mma.m16n8k8", .tf32). ldmatrix's transpose moves 16-bit halves, so a tile
  stored [k, rows] is not supported (`TRANSPOSABLE` is False);
- `mma_name("float32")`: C (16x16) += A (16x16) * B^T (16x16) as four
  `mma.sync m16n8k8` (two 8-column halves of C, two 8-deep halves of K).

Fragments are indexed `[lane, element]` (32 x 8). A's entry (i, k) at lane
`4 (i % 8) + k % 4`, element `4 (k // 8) + 2 ((k % 8) // 4) + i // 8`
(`fragment_index_a`): elements 4q..4q+3 are a0..a3 of the K-half q. B's
entry (n, k) at lane `4 (n % 8) + k % 4`, element
`4 (n // 8) + 2 (k // 8) + (k % 8) // 4` (`fragment_index_b`): elements
4h + 2q, 4h + 2q + 1 are b0, b1 of column half h and K-half q.

Registered at the first `register()`, as schedules/mma_intrinsics.py's.
"""

from __future__ import annotations

from tvm.runtime import convert
from tvm.script import tirx as T

from schedules import mma_intrinsics as mma

DTYPE = "float32"
TILE = mma.TILE
LANES = mma.LANES
ELEMENTS = mma.ELEMENTS
HALF = 8  # rows of one ldmatrix matrix; the 8-column and 8-deep halves of a tile
QUARTER = 4  # 32-bit elements per ldmatrix row (16 bytes)
TRANSPOSABLE = False  # ldmatrix's .trans moves 16-bit halves: a 32-bit tile cannot be transposed by it
FILL = mma.FILL
STORE_SHARED = mma.STORE_SHARED
SHARED = mma.SHARED
fragment_index = mma.fragment_index  # the accumulator's layout, as for m16n8k16


def fragment_index_a(i, k):
    """(lane, element) of entry (i, k) of a 16x16 tile of A ([m, k])."""
    return 4 * (i % 8) + k % 4, 4 * (k // 8) + 2 * ((k % 8) // 4) + i // 8


def fragment_index_b(n, k):
    """(lane, element) of entry (n, k) of a 16x16 tile of B ([n, k])."""
    return 4 * (n % 8) + k % 4, 4 * (n // 8) + 2 * (k // 8) + (k % 8) // 4


def ldmatrix_name(dtype: str, operand: str, trans: bool = False) -> str:
    if dtype != DTYPE or trans:
        raise ValueError(f"no TF32 ldmatrix for a {dtype} tile{' stored transposed' if trans else ''}")
    return f"tvm_stitch_ldmatrix_tf32_{operand}"


def mma_name(dtype: str) -> str:
    if dtype != DTYPE:
        raise ValueError(f"the TF32 mma takes float32 operands, not {dtype}")
    return "tvm_stitch_mma_m16n8k8_tf32_f32"


def _ldmatrix_row(lane, operand: str, call: int):
    """(row, column) of the stored tile where `lane` points the `call`-th ldmatrix .x4 at 4 elements.

    Lanes 8m..8m+7 give the rows of matrix m, which lands in fragment element 4 call + m. A: call q
    loads K-half q, matrix m rows 8 (m % 2).., columns 8q + 4 (m // 2)..; B: call h loads the
    column half h, matrix m rows 8h.., columns 4m.. .
    """
    matrix, row = lane // HALF, lane % HALF
    if operand == "a":
        return HALF * (matrix % 2) + row, HALF * call + QUARTER * (matrix // 2)
    return HALF * call + row, QUARTER * matrix


def _ldmatrix(operand: str):
    index = fragment_index_a if operand == "a" else fragment_index_b

    desc = mma.ldmatrix_desc(DTYPE, index)

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (TILE, TILE), DTYPE, align=64, offset_factor=TILE, scope=SHARED,
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:LANES, 0:ELEMENTS])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                for call in T.unroll(2):
                    row, column = T.meta_var(_ldmatrix_row(tx, operand, call))
                    T.evaluate(T.ptx_legacy.ldmatrix(
                        False, 4, ".b16", warp.data,
                        warp.elem_offset + convert(ELEMENTS) * tx + call * convert(QUARTER),
                        shared.access_ptr("r"), s0 * row + column, dtype=DTYPE))

    return desc, impl


def _mma():
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:LANES, 0:ELEMENTS], A[0:LANES, 0:ELEMENTS], B[0:LANES, 0:ELEMENTS])
            T.writes(C[0:LANES, 0:ELEMENTS])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c_lane, c_element = T.meta_var(fragment_index(vi, vj))
                    a_lane, a_element = T.meta_var(fragment_index_a(vi, vk))
                    b_lane, b_element = T.meta_var(fragment_index_b(vj, vk))
                    T.reads(C[c_lane, c_element], A[a_lane, a_element], B[b_lane, b_element])
                    T.writes(C[c_lane, c_element])
                    C[c_lane, c_element] = C[c_lane, c_element] + A[a_lane, a_element] * B[b_lane, b_element]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (LANES, ELEMENTS), DTYPE, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:LANES, 0:ELEMENTS], A[0:LANES, 0:ELEMENTS], B[0:LANES, 0:ELEMENTS])
            T.writes(C[0:LANES, 0:ELEMENTS])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                for half in T.unroll(2):
                    for depth in T.unroll(2):
                        T.evaluate(T.ptx_legacy.mma(
                            "m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                            A.data, A.elem_offset + tx * convert(ELEMENTS) + depth * convert(QUARTER),
                            B.data, B.elem_offset + tx * convert(ELEMENTS) + half * convert(QUARTER)
                            + depth * convert(2),
                            C.data, C.elem_offset + tx * convert(ELEMENTS) + half * convert(QUARTER),
                            False, dtype=DTYPE))

    return desc, impl


def register() -> None:
    """Register the TF32 ldmatrix and mma intrinsics (once)."""
    mma.register()
    for operand in ("a", "b"):
        mma.register_intrinsic(ldmatrix_name(DTYPE, operand), *_ldmatrix(operand))
    mma.register_intrinsic(mma_name(DTYPE), *_mma())
