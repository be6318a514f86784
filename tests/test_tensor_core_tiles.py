"""The tensor-core GEMM rule's tiles (schedules/cuda/tensor_core_matmul.py) under the SIMT checker: a
bfloat16 GEMM whose operand is a reshape (its wrapped indices read as vector copies within the block's
ranges), a tile shrunk to give every SM a block and K staged 64 deep, run on pocl with ldmatrix and
mma.sync emulated lane by lane, matches numpy."""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import te

from schedules.cuda import tensor_core_matmul
from schedules.tensorize_guard import tensorize_faults
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.kernel_geometry import kernel_geometries
from tvm_stitch.simt.simt_inputs import concrete_shape
from tvm_stitch.simt.simt_kernel import tolerance

from tir_text import run_on_pocl, with_static_shared

pytestmark = pytest.mark.skipif(tensorize_faults(), reason="TVM's Tensorize faults with this tvm-ffi")

SPEC = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))


def reshaped_gemm(batch: int, rows: int, k: int, n: int, dtype: str = "bfloat16"):
    """C[batch * rows, n] = reshape(X[batch, rows, k]) @ W[k, n], float32 products, the reshape through
    flat indices as LegalizeOps writes it (`flat % k`, `flat // k % rows`)."""
    x = te.placeholder((batch, rows, k), dtype, name="X")
    w = te.placeholder((k, n), dtype, name="W")
    flat = te.compute((batch * rows, k), lambda i, j: x[(i * k + j) // (rows * k), (i * k + j) // k % rows,
                                                       (i * k + j) % k], name="T_reshape")
    r = te.reduce_axis((0, k), "r")
    product = te.compute((batch * rows, n), lambda i, j: te.sum(
        flat[i, r].astype("float32") * w[r, j].astype("float32"), axis=r), name="C")
    return te.create_prim_func([x, w, product])




def test_a_small_gemm_gets_one_block_per_sm_and_deep_stages():
    tile = tensor_core_matmul.choose_tile((512, 512, 512), SPEC, 2)
    blocks = (512 // tile.rows(0)) * (512 // tile.rows(1))
    assert blocks <= SPEC.sms < 2 * blocks and tile.k_steps == tensor_core_matmul.DEEP_K_STEPS
    large = tensor_core_matmul.choose_tile((512, 512, 512), SPEC, 2, batch=8)
    assert (large.rows(0), large.rows(1)) == (128, 64)


def test_the_reshaped_operand_is_copied_in_vectors():
    """Each thread loads X and W 16 bytes at a time (eight bfloat16), none element by element."""
    func = tensor_core_matmul.apply(reshaped_gemm(4, 32, 128, 64), SPEC).mod["main"]
    (geometry,) = kernel_geometries(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    assert {width for width, _ in geometry.loads} == {SPEC.vector_bytes}


def test_the_tile_runs_under_the_simt_checker():
    """128 x 64 x 128 bfloat16: eight blocks of 32 x 32 (2 x 2 warps of one 16 x 16 tile each), two stages
    of 64 along K."""
    func = tensor_core_matmul.apply(reshaped_gemm(4, 32, 128, 64), SPEC).mod["main"]
    func = with_static_shared(func)
    rng = np.random.default_rng(0)
    x, w = (rng.uniform(-1, 1, concrete_shape(p)).astype(ml_dtypes.bfloat16) for p in func.params[:2])
    result = run_on_pocl(func, {0: x.astype(np.float32), 1: w.astype(np.float32)})
    assert not result.guard_problems
    want = x.astype(np.float64).reshape(-1, x.shape[-1]) @ w.astype(np.float64)
    rtol, atol = tolerance("bfloat16")
    got = result.outputs[2].astype(np.float64)
    assert np.all(np.abs(got - want) <= atol + rtol * np.abs(want)), float(np.abs(got - want).max())
