"""A group the planner cannot handle falls back to TVM's default path, with a reason, and stays correct."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvm_stitch
from tvm_stitch.tools.build import build, cuda_launches, run_cpu

from conftest import CUDA, LLVM, make_module, tensor

op = relax.op


def _softmax_dynamic_rows():
    """Softmax over rows of symbolic length that also returns its exponentials: on CUDA that output,
    read again inside the kernel, would need a shared buffer of symbolic size."""
    n = tirx.Var("n", "int64")
    x = tensor("x", (16, n))

    def body(bb, x):
        e = bb.emit(op.exp(op.subtract(x, op.max(x, axis=[-1], keepdims=True))))
        return relax.Tuple([e, bb.emit(op.divide(e, op.sum(e, axis=[-1], keepdims=True)))])

    return make_module([x], body)


def test_unplannable_group_falls_back_with_reason_and_right_answer(rng):
    mod = _softmax_dynamic_rows()
    report = tvm_stitch.explain(mod, CUDA)
    assert report.fallbacks, report.table()
    assert all("symbolic length" in group.fallback for group in report.fallbacks)
    assert "fallback" in report.table()
    built = build(mod, LLVM, stitched=True, emulate="cuda")  # the CUDA plans, run on the CPU
    assert built.report.fallbacks
    for cols in (1, 7, 130):
        x = rng.standard_normal((16, cols)).astype("float32")
        exps, out = run_cpu(built.executable, [x])
        e = np.exp(x - x.max(-1, keepdims=True))
        np.testing.assert_allclose(exps, e, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_fallback_on_cuda_still_builds():
    mod = _softmax_dynamic_rows()
    assert cuda_launches(mod, stitched=True) == cuda_launches(mod, stitched=False)


def test_strict_mode_turns_fallbacks_into_errors():
    with pytest.raises(tvm_stitch.StitchError, match="cannot stitch"):
        tvm_stitch.explain(_softmax_dynamic_rows(), CUDA, strict=True)


def test_group_whose_schedule_fails_to_build_falls_back():
    # Reductions over rows of 16 then over a middle axis of 1000: the first
    # schedule tried for such shapes put a barrier under a thread predicate.
    x = tensor("x", (2, 1000, 16))

    def body(bb, x):
        inner = bb.emit(op.sum(x, axis=[2], keepdims=True))
        return bb.emit(op.sum(op.multiply(x, inner), axis=[1]))

    mod = make_module([x], body)
    tvm.compile(mod, target=CUDA, relax_pipeline=tvm_stitch.pipeline(CUDA))
    built = build(mod, LLVM, stitched=True)
    data = np.random.default_rng(0).standard_normal((2, 1000, 16)).astype("float32")
    (out,) = run_cpu(built.executable, [data])
    ref = (data * data.sum(2, keepdims=True)).sum(1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
