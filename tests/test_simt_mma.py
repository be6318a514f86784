"""Tensor-core kernels under the SIMT checker: ldmatrix and mma.sync emulated lane by lane in PTX's
fragment layouts (tvm_stitch/simt/mma_emulation.py), on a GEMM tensorized with TVM's mma intrinsics."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi

from conftest import CUDA, needs_nvcc, nvcc, opencl_device
from schedules.tensorize_guard import tensorize_faults
from tvm_stitch.simt import mma_emulation, narrow_floats, opencl_run, ptx_fragments
from tvm_stitch.simt.opencl_build import build_opencl
from tvm_stitch.simt.simt_inputs import concrete_shape
from tvm_stitch.simt.simt_kernel import Reference, check_kernel, tolerance

pytestmark = pytest.mark.skipif(tensorize_faults(), reason="TVM's Tensorize faults with this tvm-ffi")

from mma_gemm import as_bfloat16, gemm, tensorized  # noqa: E402

NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _kernel(shape, b_transposed, dtype="float16", out_dtype="float32"):
    """(tensorized PrimFunc, its unscheduled reference)."""
    if dtype == "bfloat16":
        return as_bfloat16(tensorized(gemm(*shape, b_transposed), b_transposed)), gemm(*shape, b_transposed, dtype)
    return tensorized(gemm(*shape, b_transposed, dtype, out_dtype), b_transposed, out_dtype), \
        gemm(*shape, b_transposed, dtype, out_dtype)


def _run(func, inputs: list, oclgrind: bool):
    """C of the tensorized `func` run as the SIMT checker builds it; and the run's result."""
    device_func = narrow_floats.widen(mma_emulation.lane_calls(func))
    program = build_opencl(device_func, "gemm")
    program = dataclasses.replace(program, source=narrow_floats.HELPERS + program.source)
    specs = [(str(p.name), "float32", concrete_shape(p)) for p in device_func.params]
    widened = {i: a.astype(np.float32) for i, a in enumerate(inputs)}
    result = opencl_run.run(program, specs, widened, opencl_device(oclgrind), oclgrind)
    return result.outputs[2], result


def _inputs(func, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, concrete_shape(p)).astype(NUMPY[dtype]) for p in func.params[:2]]


def _numpy(a, b, b_transposed):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return a @ (b.T if b_transposed else b)


def _within_half_tolerance(got, want, dtype):
    rtol, atol = tolerance(dtype)
    assert np.all(np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want)), \
        float(np.abs(got - want).max())


@needs_nvcc
def test_the_gemm_is_tensorized_for_cuda(tmp_path):
    func, _ = _kernel((64, 64, 64), True)
    source = tvm.tirx.build(tvm.IRModule({"main": func}), target=CUDA).imports[0].inspect_source("")
    assert "ldmatrix.sync.aligned.m8n8.x4" in source and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source
    nvcc(source, tmp_path, arch="sm_80")


@pytest.mark.parametrize("shape, b_transposed, out_dtype", [
    ((64, 64, 64), True, "float32"), ((64, 64, 64), False, "float32"),
    ((128, 64, 96), True, "float16"), ((64, 128, 64), False, "float16")])
def test_tensorized_float16_gemm_matches_numpy_on_pocl(shape, b_transposed, out_dtype):
    func, ref = _kernel(shape, b_transposed, "float16", out_dtype)
    a, b = _inputs(func, "float16")
    got, result = _run(func, [a, b], oclgrind=False)
    assert not result.guard_problems
    _within_half_tolerance(got, _numpy(a, b, b_transposed), "float16")
    check = check_kernel("gemm", func, [Reference(ref, (0, 1, 2))], opencl_device(False), False, 0, [{}])
    assert check.ok and "emulated lane by lane" in check.detail, check


def test_tensorized_bfloat16_gemm_matches_numpy_on_pocl():
    func, ref = _kernel((64, 64, 64), True, "bfloat16")
    mma = []

    def visit(e):
        if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "tirx.ptx_legacy.mma":
            mma.append(e)

    tvm_ffi.structural_walk(func, (tvm.ir.Expr, visit), order="pre")
    assert mma and all(str(call.args[3].value) == "bf16" for call in mma)
    a, b = _inputs(func, "bfloat16")
    got, _ = _run(func, [a, b], oclgrind=False)
    _within_half_tolerance(got, _numpy(a, b, True), "bfloat16")
    check = check_kernel("gemm", func, [Reference(ref, (0, 1, 2))], opencl_device(False), False, 0, [{}])
    assert check.ok, check


def test_tensorized_gemm_is_clean_under_oclgrind():
    func, ref = _kernel((64, 64, 64), True)
    a, b = _inputs(func, "float16")
    got, result = _run(func, [a, b], oclgrind=True)
    assert not result.findings, result.findings
    _within_half_tolerance(got, _numpy(a, b, True), "float16")


def test_an_exchange_without_its_closing_barrier_is_a_race_under_oclgrind(monkeypatch):
    """The mma's exchange reused by the next call while other lanes still read it: Oclgrind sees it."""
    true = mma_emulation.helpers
    barrier = "barrier(CLK_LOCAL_MEM_FENCE);"

    def racy():
        text = true()
        closing = text.index(barrier, text.index("c[c_off + i] = acc;"))
        return text[:closing] + text[closing + len(barrier):]

    monkeypatch.setattr(mma_emulation, "helpers", racy)
    func, _ = _kernel((64, 64, 64), True)
    _, result = _run(func, list(_inputs(func, "float16")), oclgrind=True)
    assert any(f.status == "race" and "local memory" in f.headline for f in result.findings), result.findings


def _swap_lanes(layout, first, second):
    return lambda lane, i: layout({first: second, second: first}.get(lane, lane), i)


WRONG_LAYOUTS = {
    "A rows of lanes 0 and 4 exchanged": ("mma_a", lambda true: _swap_lanes(true, 0, 4)),
    "B columns of lanes 1 and 5 exchanged": ("mma_b", lambda true: _swap_lanes(true, 1, 5)),
    "C of lanes 2 and 3 exchanged": ("mma_c", lambda true: _swap_lanes(true, 2, 3)),
    "groupID and threadID_in_group swapped": ("group_of", lambda true: lambda lane: ((lane % 4) * 2 + lane // 16,
                                                                                    (lane >> 2) % 4)),
    "ldmatrix row addresses of lanes 0 and 8 exchanged": ("ldmatrix_row_given",
                                                           lambda true: lambda lane: true({0: 8, 8: 0}.get(lane, lane))),
    "ldmatrix elements of lanes 6 and 9 exchanged": ("ldmatrix_element", lambda true: _swap_lanes(true, 6, 9)),
}
# Not among them: a permutation of k applied alike to A's and B's fragments (the pairs of every
# ldmatrix register taken in the other order) leaves every product unchanged, on a GPU as here.


@pytest.mark.parametrize("wrong", sorted(WRONG_LAYOUTS))
def test_a_wrong_fragment_layout_fails_the_simt_check(wrong, monkeypatch):
    name, make = WRONG_LAYOUTS[wrong]
    monkeypatch.setattr(ptx_fragments, name, make(getattr(ptx_fragments, name)))
    func, ref = _kernel((64, 64, 64), True)
    check = check_kernel("gemm", func, [Reference(ref, (0, 1, 2))], opencl_device(False), False, 0, [{}])
    assert check.status == "mismatch", check


def test_fragment_layouts_cover_each_matrix_once_and_match_ptx_figures():
    lanes = range(ptx_fragments.WARP)
    for layout, count, rows, cols in ((ptx_fragments.mma_a, 8, 16, 16), (ptx_fragments.mma_b, 4, 16, 8),
                                      (ptx_fragments.mma_c, 4, 16, 8)):
        cells = [layout(lane, i) for lane in lanes for i in range(count)]
        assert sorted(cells) == [(r, c) for r in range(rows) for c in range(cols)]
    assert sorted(ptx_fragments.ldmatrix_element(lane, j) for lane in lanes for j in range(2)) == \
        [(r, c) for r in range(8) for c in range(8)]
    # lane 5: groupID 1, threadID_in_group 1
    assert ptx_fragments.mma_a(5, 0) == (1, 2) and ptx_fragments.mma_a(5, 7) == (9, 11)
    assert ptx_fragments.mma_b(5, 3) == (11, 1) and ptx_fragments.mma_c(5, 2) == (9, 2)


def test_an_mma_shape_not_emulated_is_unsupported():
    func, ref = _kernel((64, 64, 64), True)

    def other_shape(e):
        return tvm.ir.StringImm("m16n8k8") if type(e).__name__ == "StringImm" and e.value == "m16n8k16" else e

    func = tvm_ffi.structural_map(func, [(tvm.ir.Expr, other_shape)], order="post")
    check = check_kernel("gemm", func, [Reference(ref, (0, 1, 2))], opencl_device(False), False, 0, [{}])
    assert check.status == "unsupported" and "m16n8k8" in check.detail, check
