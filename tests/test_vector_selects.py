"""A select under a vectorised loop (a slice_scatter folded into dlight's matmul load) compiles for CUDA."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_stitch.pipeline import GuardedDefaultSchedule, VectorSelectsAsBranches, stitch_passes
from schedules.cuda.vector_selects import selects_as_branches  # after tvm_stitch: schedules imports it
from tvm_stitch.report import StitchReport
from tvm_stitch.target import as_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import cuda_source, launches_by_kind

from conftest import needs_nvcc, nvcc, opencl_device

CUDA = {"kind": "cuda", "arch": "sm_90"}


def _row_scatter_matmul():
    """The rows of a matmul's left operand from a slice_scatter: the select's condition is the same
    for every lane of dlight's vectorised global-to-shared load (LLaMA's backward rotary embedding)."""

    @tvm.script.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((16, 64), "float32"), y: R.Tensor((32, 64), "float32"),
                 w: R.Tensor((64, 64), "float32")):
            with R.dataflow():
                g = R.slice_scatter(y, x, 16, 32, 1, axis=0)
                out = R.matmul(g, w)
                R.output(out)
            return out

    return Module


def _relu_of_scatter_matmul():
    """A select whose condition compares the values of another select (a ReLU of a slice_scatter)."""

    @tvm.script.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((64, 16), "float32"), y: R.Tensor((64, 32), "float32"),
                 w: R.Tensor((32, 32), "float32")):
            with R.dataflow():
                g = R.slice_scatter(y, x, 16, 32, 1, axis=1)
                h = R.where(R.greater(g, R.const(0.0, "float32")), g, R.const(0.0, "float32"))
                out = R.matmul(h, w)
                R.output(out)
            return out

    return Module


@needs_nvcc
@pytest.mark.parametrize("graph", [_row_scatter_matmul, _relu_of_scatter_matmul])
def test_select_folded_into_matmul_compiles_with_nvcc(graph, tmp_path):
    built = build(graph(), CUDA, stitched=True)
    assert launches_by_kind(built.lowered, built.executable) == (0, 1)  # the scatter stays folded
    nvcc(cuda_source(built.executable), tmp_path, ptx=True)


@pytest.mark.parametrize("graph", [_row_scatter_matmul, _relu_of_scatter_matmul])
def test_rewritten_matmul_kernel_matches_on_pocl(graph):
    pytest.importorskip("pyopencl")
    from tvm_stitch.simt.simt_kernel import Reference, check_kernel

    device = opencl_device(False)
    target = as_target(CUDA)
    with target:
        fused = tvm.transform.Sequential(stitch_passes(target, report=StitchReport()) + [relax.transform.FuseTIR()])(
            graph())
        (name,) = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
        unscheduled = fused[name]  # the passes below update the module in place
        dlight = GuardedDefaultSchedule()(fused)[name]
        scheduled = VectorSelectsAsBranches()(fused)[name]
    assert "T.Select" in dlight.script() and "T.Select" not in scheduled.script()
    reference = Reference(unscheduled, tuple(range(len(unscheduled.params))))
    check = check_kernel(name, scheduled, [reference], device, oclgrind=False, seed=0)
    assert check.status == "ok", check


def test_only_selects_under_vectorised_loops_are_rewritten():
    @T.prim_func(private=True)
    def func(a: T.Buffer((8, 4), "float32"), b: T.Buffer((8, 4), "float32"), c: T.Buffer((8,), "float32")):
        for i in range(8):
            for j in T.vectorized(4):
                b[i, j] = T.Select(i < 4, a[i, j], T.float32(0))
            c[i] = T.Select(i < 2, a[i, 0], T.float32(1))

    rewritten = selects_as_branches(func)
    text = rewritten.script()
    assert text.count("T.if_then_else") == 1 and text.count("T.Select") == 1
    lib = tvm.tirx.build(tvm.IRModule({"main": rewritten.with_attr("global_symbol", "main")}), target="llvm")
    a = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    b, c = tvm.runtime.empty((8, 4), "float32"), tvm.runtime.empty((8,), "float32")
    lib["main"](tvm.runtime.tensor(a), b, c)
    np.testing.assert_array_equal(b.numpy(), np.where(np.arange(8)[:, None] < 4, a, 0))
    np.testing.assert_array_equal(c.numpy(), np.where(np.arange(8) < 2, a[:, 0], 1))
