"""The bfloat16/float16 ldmatrix and mma.sync intrinsics (schedules/mma_intrinsics.py) against an
emulation of the PTX instructions written from the PTX ISA's fragment tables: what each
implementation puts in (and reads from) a lane's registers is what its description says."""

import subprocess
import sys

import numpy as np
import pytest
from tvm.s_tir import TensorIntrin

import tvm_stitch  # noqa: F401 - imports the package before schedules (its import order)
from schedules import mma_intrinsics as mma

mma.register()

LANES = 32


def _ldmatrix_x4(stored: np.ndarray, operand: str, trans: bool) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16 as the PTX ISA states it: lanes 8i..8i+7 give the
    row addresses of matrix i, which lands in register i; lane l receives row l/4, columns
    2 (l % 4) and 2 (l % 4) + 1 of its matrix (of the transposed matrix with .trans)."""
    regs = np.zeros((LANES, 8), stored.dtype)
    for matrix in range(4):
        rows = []
        for r in range(8):
            row, column = mma.ldmatrix_row(8 * matrix + r, operand, trans)
            rows.append(stored[row, column:column + 8])
        block = np.array(rows)
        if trans:
            block = block.T
        for lane in range(LANES):
            regs[lane, 2 * matrix:2 * matrix + 2] = block[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2]
    return regs


def _mma_m16n8k16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32 on per-lane registers a (8), b (4), c (4), laid out as
    the PTX ISA's "Matrix Fragments for mma.m16n8k16" tables (groupID = lane / 4, t = lane % 4)."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for i in range(8):
            A[g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)] = a[lane, i]
        for i in range(4):
            B[2 * t + i % 2 + 8 * (i // 2), g] = b[lane, i]
            C[g + 8 * (i // 2), 2 * t + i % 2] = c[lane, i]
    D = A @ B + C
    out = np.zeros_like(c)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for i in range(4):
            out[lane, i] = D[g + 8 * (i // 2), 2 * t + i % 2]
    return out


def _fragment(tile: np.ndarray, index) -> np.ndarray:
    """The [lane, element] fragment the intrinsics' descriptions give a 16x16 tile."""
    regs = np.zeros((LANES, 8), tile.dtype)
    for i in range(16):
        for j in range(16):
            regs[index(i, j)] = tile[i, j]
    return regs


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("trans", [False, True], ids=["k-major", "transposed"])
def test_ldmatrix_puts_each_element_where_the_description_says(operand, trans):
    index = mma.fragment_index if operand == "a" else mma.fragment_index_b
    tile = np.arange(256, dtype=np.float64).reshape(16, 16)  # [rows, k]
    stored = tile.T.copy() if trans else tile
    assert np.array_equal(_ldmatrix_x4(stored, operand, trans), _fragment(tile, index))


def test_the_two_mmas_compute_the_tile_product_the_description_states(rng):
    a, b, c = rng.standard_normal((16, 16)), rng.standard_normal((16, 16)), rng.standard_normal((16, 16))
    fa, fb, fc = _fragment(a, mma.fragment_index), _fragment(b, mma.fragment_index_b), _fragment(c, mma.fragment_index)
    out = fc.copy()
    for half in (0, 1):  # as the implementation: B and C registers at element offsets 0 and 4
        out[:, 4 * half:4 * half + 4] = _mma_m16n8k16(fa, fb[:, 4 * half:4 * half + 4], fc[:, 4 * half:4 * half + 4])
    expected = _fragment(c + a @ b.T, mma.fragment_index)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_a_misplaced_fragment_is_caught(rng):
    """The emulation can fail: B read with A's layout gives another product."""
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 16))
    fa, fb = _fragment(a, mma.fragment_index), _fragment(b, mma.fragment_index)
    zero = np.zeros((LANES, 4))
    out = np.concatenate([_mma_m16n8k16(fa, fb[:, 0:4], zero), _mma_m16n8k16(fa, fb[:, 4:8], zero)], axis=1)
    assert not np.allclose(out, _fragment(a @ b.T, mma.fragment_index))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_intrinsics_are_registered_for_both_half_dtypes(dtype):
    ptx = mma.DTYPES[dtype]
    impl = TensorIntrin.get(mma.mma_name(dtype)).impl.script()
    assert impl.count(f'"{ptx}", "{ptx}", "fp32"') == 1 and '"m16n8k16"' in impl
    for operand in ("a", "b"):
        for trans in (False, True):
            load = TensorIntrin.get(mma.ldmatrix_name(dtype, operand, trans)).impl.script()
            assert "ptx_legacy.ldmatrix" in load and dtype in load


def test_fragment_position_inverts_fragment_index():
    """The accumulator store's per-lane positions are the inverse of the fill/mma layout: every one of
    the 256 entries of a 16x16 tile has one (lane, element) and back."""
    seen = {mma.fragment_index(i, j): (i, j) for i in range(mma.TILE) for j in range(mma.TILE)}
    assert len(seen) == mma.TILE * mma.TILE
    assert all(mma.fragment_position(lane, element) == ij for (lane, element), ij in seen.items())


def test_importing_tvm_stitch_does_not_load_tvms_tensor_intrinsics():
    """TVM's tensor-intrinsic module costs about 30 s of CPU to import; no build path needs it."""
    code = "import sys, tvm_stitch, tvm_stitch.torch; print('tvm.s_tir.tensor_intrin.cuda' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
