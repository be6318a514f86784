"""Tuple reductions (one block writing several buffers: argmax's index and value, the sum and sum of
squares of TVM's legalized group_norm and instance_norm) stitch on CUDA: every buffer the block
writes lives on chip, as CUDA lowering requires."""


import numpy as np
import pytest
from tvm import relax

from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import cuda_source, launches_by_kind

from conftest import CUDA, LLVM, NVCC, make_module, nvcc, static_shape, tensor

N, C, H, W = 2, 8, 4, 6
EPS = 1e-5


def _norm(x, g, b, axes):
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * g.reshape(1, C, 1, 1) + b.reshape(1, C, 1, 1)


def _group_norm(x, g, b):
    grouped = x.reshape(N, 4, C // 4, H, W)
    mean = grouped.mean(axis=(2, 3, 4), keepdims=True)
    var = ((grouped - mean) ** 2).mean(axis=(2, 3, 4), keepdims=True)
    return ((grouped - mean) / np.sqrt(var + EPS)).reshape(N, C, H, W) * g.reshape(1, C, 1, 1) + b.reshape(1, C, 1, 1)


CASES = {
    "argmax": (lambda bb, x, g, b: bb.emit(relax.op.argmax(x, axis=3)), lambda x, g, b: x.argmax(axis=3)),
    "instance_norm": (lambda bb, x, g, b: bb.emit(relax.op.nn.instance_norm(x, g, b, channel_axis=1, axes=[2, 3])),
                      lambda x, g, b: _norm(x, g, b, (2, 3))),
    "group_norm": (lambda bb, x, g, b: bb.emit(relax.op.nn.group_norm(x, g, b, num_groups=4, channel_axis=1,
                                                                       axes=[2, 3])), _group_norm),
}


def _module(name):
    body, _ = CASES[name]
    return make_module([tensor("x", (N, C, H, W)), tensor("g", (C,)), tensor("b", (C,))], body)


@pytest.mark.parametrize("name", list(CASES))
def test_tuple_reduction_is_one_stitched_cuda_kernel(name, tmp_path):
    built = build(_module(name), CUDA, stitched=True, strict=True)
    assert built.report.plans and not built.report.fallbacks
    assert launches_by_kind(built.lowered, built.executable)[0] == 1
    if NVCC is not None:
        nvcc(cuda_source(built.executable), tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_tuple_reduction_cuda_plan_matches_numpy_on_the_cpu(name, rng):
    mod = _module(name)
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") for v in mod["main"].params]
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    (out,) = run_cpu(built.executable, inputs)
    expected = CASES[name][1](*[a.astype(np.float64) for a in inputs])
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-4, atol=1e-4)
