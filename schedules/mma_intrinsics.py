"""Warp-level tensor-core intrinsics for half-precision GEMMs: ldmatrix and mma.sync m16n8k16.

TVM 0.27 (`tvm/s_tir/tensor_intrin/cuda.py`) registers ldmatrix and
mma.sync intrinsics for float16, int8 and float8 only. PTX has
`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` from sm_80 (PTX ISA,
"Warp-level matrix multiply-accumulate instructions"), and `ldmatrix` moves
16-bit elements whatever they encode. This module registers, for float16
and bfloat16 alike, the intrinsics one warp-tile of the normalised GEMM
`C[i, j] += A[i, k] * B[j, k]` (both operands K-major, float32
accumulator) needs:

- `ldmatrix_name(dtype, "a")` / `"b"`: a 16x16 tile of shared memory
  (`shared.dyn`) into the warp's fragment (`ldmatrix.sync.aligned.m8n8.x4`);
- `mma_name(dtype)`: C (16x16, float32) += A (16x16) * B^T (16x16), as two
  `mma.sync m16n8k16` (the two 8-column halves of C).

The fragment of a 16x16 tile is indexed `[lane, element]` (32 x 8): A's
and the accumulator's entry (i, j) at lane `4 (i % 8) + (j % 8) // 2` and
element `4 (j // 8) + 2 (i // 8) + j % 2` (`fragment_index`), B's entry
(n, k) at lane `4 (n % 8) + (k % 8) // 2` and element
`4 (n // 8) + 2 (k // 8) + k % 2` (`fragment_index_b`): the register
layouts of the m16n8k16 operands and accumulator in the PTX ISA, B's for
the two 8-column mmas one after the other. Beside them, the float32
accumulator's fill with zeros (`FILL`) and its store to shared memory
(`STORE_SHARED`, each lane its own eight elements, `fragment_position`).

Registration happens once, at the first `register()` (the tensor-core rule
calls it before it tensorizes: parsing the intrinsics costs about a second,
not paid by builds without a half-precision GEMM); a name already
registered is left as it is. TVM's own tensor-intrinsic module (hundreds of
intrinsics, about 30 s of CPU to import) is not needed.
"""

from __future__ import annotations

from tvm.runtime import convert
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.tirx import Cast

TILE = 16  # rows, columns and depth of one fragment tile
LANES = 32
ELEMENTS = TILE * TILE // LANES  # per lane: 8
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}  # operand dtypes and their PTX spelling
FILL = "tvm_stitch_mma_fill_f32"
STORE_SHARED = "tvm_stitch_mma_store_f32_shared"
SHARED = "shared.dyn"
TRANSPOSABLE = True  # ldmatrix .trans loads a tile stored [k, rows]


def fragment_index(i, j):
    """(lane, element) of entry (i, j) of a 16x16 tile of A ([m, k]) or of the accumulator ([m, n])."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + 2 * (i // 8) + j % 2


def fragment_position(lane, element):
    """(i, j) of a lane's element of a 16x16 A or accumulator tile: the inverse of `fragment_index`."""
    return lane // 4 + 8 * ((element // 2) % 2), 8 * (element // 4) + 2 * (lane % 4) + element % 2


fragment_index_a = fragment_index  # A's layout is the accumulator's


def fragment_index_b(n, k):
    """(lane, element) of entry (n, k) of a 16x16 tile of B ([n, k]): elements 0-3 are the B operand
    of the mma of columns n 0-7 (k 0-7, then k 8-15), elements 4-7 that of columns n 8-15."""
    return 4 * (n % 8) + (k % 8) // 2, 4 * (n // 8) + 2 * (k // 8) + k % 2


def ldmatrix_name(dtype: str, operand: str, trans: bool = False) -> str:
    """`trans`: the tile is stored [k, m] (A) or [k, n] (B) in shared memory, ldmatrix transposes."""
    return f"tvm_stitch_ldmatrix_{DTYPES[dtype]}_{operand}{'_trans' if trans else ''}"


def mma_name(dtype: str) -> str:
    return f"tvm_stitch_mma_m16n8k16_{DTYPES[dtype]}_f32"


def ldmatrix_row(lane, operand: str, trans: bool):
    """The (row, column) of the stored tile where lane `lane` points ldmatrix at 8 elements.

    ldmatrix .x4 loads four 8x8 matrices; lanes 8m..8m+7 give the rows of matrix m, which lands in
    fragment register m. A's registers hold (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
    (m 8-15, k 8-15); B's hold (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15):
    the two k-halves of the first 8-column mma, then of the second. A tile stored K-major gives them
    as they are; one stored [k, m] or [k, n] through ldmatrix's transpose.
    """
    matrix, row = lane // 8, lane % 8
    outer, depth = (matrix % 2, matrix // 2) if operand == "a" else (matrix // 2, matrix % 2)
    if trans:
        return 8 * depth + row, 8 * outer
    return 8 * outer + row, 8 * depth


def ldmatrix_desc(dtype: str, entry):
    """The description of an ldmatrix intrinsic: the 16x16 shared tile's entry [v0, v1] copied to the
    warp fragment's (lane, element) `entry(v0, v1)`."""
    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope=SHARED)
        warp = T.match_buffer(warp_handle, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:LANES, 0:ELEMENTS])
            for ax0, ax1 in T.grid(TILE, TILE):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    lane, element = T.meta_var(entry(v0, v1))
                    T.reads(shared[v0, v1])
                    T.writes(warp[lane, element])
                    warp[lane, element] = shared[v0, v1]

    return desc


def _ldmatrix(dtype: str, operand: str, trans: bool):
    index = fragment_index if operand == "a" else fragment_index_b

    def entry(v0, v1):
        """The fragment's (lane, element) of the stored tile's entry [v0, v1]."""
        return index(v1, v0) if trans else index(v0, v1)

    desc = ldmatrix_desc(dtype, entry)

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope=SHARED,
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:LANES, 0:ELEMENTS])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                row, column = T.meta_var(ldmatrix_row(tx, operand, trans))
                T.evaluate(T.ptx_legacy.ldmatrix(
                    trans, 4, ".b16", warp.data, warp.elem_offset + convert(ELEMENTS) * tx,
                    shared.access_ptr("r"), s0 * row + column, dtype=dtype))

    return desc, impl


def _mma(dtype: str):
    ptx = DTYPES[dtype]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (LANES, ELEMENTS), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:LANES, 0:ELEMENTS], A[0:LANES, 0:ELEMENTS], B[0:LANES, 0:ELEMENTS])
            T.writes(C[0:LANES, 0:ELEMENTS])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c_lane, c_element = T.meta_var(fragment_index(vi, vj))
                    a_lane, a_element = T.meta_var(fragment_index(vi, vk))
                    b_lane, b_element = T.meta_var(fragment_index_b(vj, vk))
                    T.reads(C[c_lane, c_element], A[a_lane, a_element], B[b_lane, b_element])
                    T.writes(C[c_lane, c_element])
                    C[c_lane, c_element] += Cast("float32", A[a_lane, a_element]) * Cast("float32", B[b_lane, b_element])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (LANES, ELEMENTS), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (LANES, ELEMENTS), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:LANES, 0:ELEMENTS], A[0:LANES, 0:ELEMENTS], B[0:LANES, 0:ELEMENTS])
            T.writes(C[0:LANES, 0:ELEMENTS])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                for half in T.unroll(2):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", ptx, ptx, "fp32",
                        A.data, A.elem_offset + tx * convert(ELEMENTS),
                        B.data, B.elem_offset + tx * convert(ELEMENTS) + half * convert(ELEMENTS // 2),
                        C.data, C.elem_offset + tx * convert(ELEMENTS) + half * convert(ELEMENTS // 2),
                        False, dtype="float32"))

    return desc, impl


def _fill():
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (LANES, ELEMENTS), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:LANES, 0:ELEMENTS])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("C"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    lane, element = T.meta_var(fragment_index(vi, vj))
                    T.reads()
                    T.writes(C[lane, element])
                    C[lane, element] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = T.match_buffer(c, (LANES, ELEMENTS), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:LANES, 0:ELEMENTS])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(ELEMENTS, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


def _store_shared():
    @T.prim_func(s_tir=True)
    def desc(c_warp: T.handle, c: T.handle) -> None:
        W = T.match_buffer(c_warp, (LANES, ELEMENTS), "float32", scope="warp")
        C = T.match_buffer(c, (TILE, TILE), "float32", scope=SHARED)
        with T.sblock("root"):
            T.reads(W[0:LANES, 0:ELEMENTS])
            T.writes(C[0:TILE, 0:TILE])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("C"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    lane, element = T.meta_var(fragment_index(vi, vj))
                    T.reads(W[lane, element])
                    T.writes(C[vi, vj])
                    C[vi, vj] = W[lane, element]

    @T.prim_func(s_tir=True)
    def impl(c_warp: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        W = T.match_buffer(c_warp, (LANES, ELEMENTS), "float32", scope="warp", offset_factor=1)
        C = T.match_buffer(c, (TILE, TILE), "float32", scope=SHARED, offset_factor=1, strides=[s0, s1])
        with T.sblock("root"):
            T.reads(W[0:LANES, 0:ELEMENTS])
            T.writes(C[0:TILE, 0:TILE])
            for tx in T.thread_binding(0, LANES, "threadIdx.x"):
                for element in T.serial(ELEMENTS):
                    row, column = T.meta_var(fragment_position(tx, element))
                    C[row, column] = W[tx, element]

    return desc, impl


def register_intrinsic(name: str, desc, impl) -> None:
    """Register `name` unless it is registered already."""
    try:
        TensorIntrin.get(name)
    except Exception:  # noqa: BLE001 - TensorIntrin.get raises for a name not registered
        TensorIntrin.register(name, desc, impl)


def register() -> None:
    """Register the ldmatrix and mma intrinsics of every dtype in DTYPES, the accumulator's fill and its
    store (once)."""
    register_intrinsic(FILL, *_fill())
    register_intrinsic(STORE_SHARED, *_store_shared())
    for dtype in DTYPES:
        for operand in ("a", "b"):
            for trans in (False, True):
                register_intrinsic(ldmatrix_name(dtype, operand, trans), *_ldmatrix(dtype, operand, trans))
        register_intrinsic(mma_name(dtype), *_mma(dtype))
