"""Small GEMMs (a batched matmul with one operand of fewer than MMA_NARROW_SIDE rows or columns
per batch) are reductions that stitch with their element-wise and reduction neighbours: DIEN-style
attention pooling is one kernel. Larger, unbatched or symbolic ones stay compute-intensive."""

import re

import numpy as np
import pytest
from tvm import relax, tirx

from tvm_stitch.explain import explain
from tvm_stitch.analysis.classify import MMA_NARROW_SIDE, OpKind, classify_primfunc
from tvm_stitch.tools.build import build, cuda_launches, run_cpu
from tvm_stitch.tools.launches import cuda_source

from conftest import CUDA, LLVM, legalized, make_module, needs_nvcc, nvcc, opencl_device, tensor

op = relax.op


def _matmul_kind(a_shape, b_shape) -> OpKind:
    a, b = tensor("a", a_shape), tensor("b", b_shape)
    mod = legalized(make_module([a, b], lambda bb, a, b: bb.emit(op.matmul(a, b))))
    (func,) = [f for gv, f in mod.functions_items() if gv.name_hint != "main"]
    return classify_primfunc(func).kind


@pytest.mark.parametrize("a_shape,b_shape,kind", [
    ((64, 1, 200), (64, 200, 64), OpKind.REDUCTION),  # attention pooling, M = 1
    ((64, MMA_NARROW_SIDE - 1, 200), (64, 200, 64), OpKind.REDUCTION),
    ((64, 64, 200), (64, 200, 1), OpKind.REDUCTION),  # a per-row weighted sum, N = 1
    ((64, MMA_NARROW_SIDE, 200), (64, 200, 64), OpKind.COMPUTE),
    ((8, 12, 128, 64), (8, 12, 64, 128), OpKind.COMPUTE),  # attention scores
    ((1, 768), (768, 3072), OpKind.COMPUTE),  # a linear layer: no batch in common, dlight's GEMV
    ((4, 2, 768), (768, 3072), OpKind.COMPUTE),
])
def test_small_batched_matmul_is_a_reduction(a_shape, b_shape, kind):
    assert _matmul_kind(a_shape, b_shape) == kind


def test_symbolic_small_side_stays_compute():
    m = tirx.Var("m", "int64")
    assert _matmul_kind((64, m, 200), (64, 200, 64)) == OpKind.COMPUTE


def _pooling(batch, keys, dim):
    """DIEN-style attention pooling: scores = sum(q * K, -1), softmax over the keys, matmul with V."""
    q, k, v = tensor("q", (batch, 1, dim)), tensor("K", (batch, keys, dim)), tensor("V", (batch, keys, dim))

    def body(bb, q, k, v):
        scores = bb.emit(op.sum(op.multiply(q, k), axis=[-1]))
        weights = bb.emit(op.expand_dims(op.nn.softmax(scores, axis=-1), 1))
        return bb.emit(op.matmul(weights, v))

    def ref(q, k, v):
        scores = (q * k).sum(-1)
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True))[:, None, :] @ v

    return make_module([q, k, v], body), ref


def _inputs(mod, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, [int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]


def test_attention_pooling_is_one_cuda_launch():
    mod, _ = _pooling(64, 200, 64)
    assert cuda_launches(mod, True) == 1


def test_explain_shows_the_matmul_in_the_stitched_kernel():
    mod, _ = _pooling(64, 200, 64)
    report = explain(mod, CUDA)
    (plan,) = report.plans
    assert "matmul" in plan.ops and "T_softmax_maxelem" in plan.ops
    (row,) = [line for line in str(report).splitlines() if line.startswith("stitch_")]
    assert "matmul" in row.split()[1] and "softmax" in row.split()[1]


@pytest.mark.parametrize("emulate", [None, "cuda"])
def test_attention_pooling_matches_numpy(emulate):
    mod, ref = _pooling(64, 200, 64)
    built = build(mod, LLVM, stitched=True, strict=True, emulate=emulate)
    (plan,) = built.report.plans
    assert "matmul" in plan.ops
    inputs = _inputs(mod)
    (out,) = run_cpu(built.executable, inputs)
    np.testing.assert_allclose(out, ref(*[i.astype("float64") for i in inputs]), rtol=1e-5, atol=1e-6)


def _weighted_sum(batch, rows, cols):
    """A per-row weighted sum: matmul(X (B, R, C), w (B, C, 1)) of softmax weights, then scaled."""
    x, s = tensor("x", (batch, rows, cols)), tensor("s", (batch, cols))

    def body(bb, x, s):
        w = bb.emit(op.expand_dims(op.nn.softmax(s, axis=-1), 2))
        return bb.emit(op.multiply(op.matmul(x, w), relax.const(0.5, "float32")))

    def ref(x, s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return 0.5 * (x @ (e / e.sum(-1, keepdims=True))[:, :, None])

    return make_module([x, s], body), ref


def test_weighted_sum_matches_numpy_emulated():
    """The matmul is stitched (with its epilogue; whether the softmax joins is the time model's call)."""
    mod, ref = _weighted_sum(16, 48, 96)
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    assert any("matmul" in plan.ops for plan in built.report.plans)
    inputs = _inputs(mod, 1)
    (out,) = run_cpu(built.executable, inputs)
    np.testing.assert_allclose(out, ref(*[i.astype("float64") for i in inputs]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("oclgrind,shape", [
    (False, (64, 200, 64)),
    pytest.param(True, (8, 40, 16), marks=pytest.mark.slow),
], ids=["pocl", "oclgrind"])
def test_attention_pooling_is_clean_under_simt(oclgrind, shape):
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    opencl_device(oclgrind)
    mod, _ = _pooling(*shape)
    report = simt.check(mod, oclgrind=oclgrind)
    assert report.ok, str(report)
    assert [k.launches for k in report.kernels] == [1], str(report)
    (plan,) = report.stitch.plans
    assert "matmul" in plan.ops and "T_softmax_maxelem" in plan.ops


@needs_nvcc
def test_attention_pooling_compiles_with_nvcc_without_spills(tmp_path):
    mod, _ = _pooling(64, 200, 64)
    source = cuda_source(build(mod, CUDA, stitched=True, strict=True).executable)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(source, tmp_path))]
    assert spills and max(spills) == 0
