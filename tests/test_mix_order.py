"""Mix-order norm backward (CUDA): dx's row reductions and dgamma/dbeta's column reductions of the
same rows planned as one group: kernel 0 reads x and dy once, kernel 1 sums the column partials.

Numerics: the CUDA schedule built for llvm without thread bindings (emulated CUDA) against numpy,
with a random cotangent; modeled time against the two-kernel plan (row-resident dx, column-split
dgamma/dbeta) of the same group split as greedy partition splits it.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

from schedules import schedule_for
from tvm_stitch.analysis.graph import analyses_for, build_graph
from tvm_stitch.kernels.outline import outline_group
from tvm_stitch.pipeline import grouping_passes
from tvm_stitch.planning.cuda.mix_order import MixOrderError, plan_mix_order
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import TargetSpec

from tvm_stitch.tools.build import build

from conftest import CUDA, LLVM, make_module, opencl_device, tensor

SM90 = TargetSpec.from_target(CUDA)
op = relax.op


def _layernorm_backward(rows, cols, dtype):
    params = [tensor("x", (rows, cols), dtype), tensor("dy", (rows, cols), dtype), tensor("mean", (rows, 1), dtype),
              tensor("rstd", (rows, 1), dtype), tensor("gamma", (cols,), dtype)]

    def body(bb, x, dy, mean, rstd, g):
        xhat = bb.emit(op.multiply(op.subtract(x, mean), rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0]))
        dbeta = bb.emit(op.sum(dy, axis=[0]))
        dxhat = bb.emit(op.multiply(dy, g))
        m1 = bb.emit(op.mean(dxhat, axis=[-1], keepdims=True))
        m2 = bb.emit(op.mean(op.multiply(dxhat, xhat), axis=[-1], keepdims=True))
        dx = bb.emit(op.multiply(rstd, op.subtract(op.subtract(dxhat, m1), op.multiply(xhat, m2))))
        return relax.Tuple([dx, dgamma, dbeta])

    def reference(x, dy, mean, rstd, g):  # outputs in binding order: dgamma, dbeta, dx
        xhat = (x - mean) * rstd
        dxhat = dy * g
        dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        return (dy * xhat).sum(0), dy.sum(0), dx

    return make_module(params, body), reference, [p.name for p in params]


def _rmsnorm_backward(rows, cols, dtype):
    params = [tensor("x", (rows, cols), dtype), tensor("dy", (rows, cols), dtype), tensor("rstd", (rows, 1), dtype),
              tensor("gamma", (cols,), dtype)]

    def body(bb, x, dy, rstd, g):
        xhat = bb.emit(op.multiply(x, rstd))
        dgamma = bb.emit(op.sum(op.multiply(dy, xhat), axis=[0]))
        dxhat = bb.emit(op.multiply(dy, g))
        m = bb.emit(op.mean(op.multiply(dxhat, xhat), axis=[-1], keepdims=True))
        dx = bb.emit(op.multiply(rstd, op.subtract(dxhat, op.multiply(xhat, m))))
        return relax.Tuple([dx, dgamma])

    def reference(x, dy, rstd, g):  # outputs in binding order: dgamma, dx
        xhat = x * rstd
        dxhat = dy * g
        return (dy * xhat).sum(0), rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))

    return make_module(params, body), reference, [p.name for p in params]


def _whole_group(mod):
    """The module's stitchable bindings outlined as one fused PrimFunc (the group mix-order plans)."""
    with CUDA:
        mod = tvm.transform.Sequential(grouping_passes(CUDA))(mod)
    main = mod["main"]
    graph = build_graph(mod, main.body.blocks[0], set(relax.analysis.free_vars(main.body.body)), analyses_for(mod))
    return outline_group(mod, graph, [n.index for n in graph.nodes if n.stitchable], "mix").func


def _run_emulated(func, plan, reference, names, rng, dtype):
    """The plan's schedule built for llvm without thread bindings, run on random inputs (a random
    cotangent dy), its outputs against numpy's in float64 (outputs in binding order)."""
    scheduled = schedule_for(func, plan, LLVM).mod["main"]
    built = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=LLVM)
    params = [p for p in scheduled.params if isinstance(p.ty, tvm.tirx.BufferType)]
    values = {n: rng.standard_normal([int(d) for d in p.shape]).astype(dtype)
              for n, p in ((p.name, p) for p in params) if n in names}
    values["rstd"] = np.abs(values["rstd"]) + np.asarray(0.5, dtype)
    expected = reference(*[values[n].astype("float64") for n in names])
    outputs = [tvm.runtime.tensor(np.zeros([int(d) for d in p.shape], dtype)) for p in params[len(values):]]
    built(*[tvm.runtime.tensor(values[p.name]) for p in params[:len(values)]], *outputs)
    return outputs, expected


@pytest.mark.parametrize("make", [_layernorm_backward, _rmsnorm_backward])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mix_order_matches_numpy_emulated(make, dtype, rng):
    mod, reference, names = make(264, 128, dtype)
    func = _whole_group(mod)
    plan = plan_kernel(func, SM90, "mix")
    assert plan.scheme == "mix-order" and plan.kernels == 2, plan.notes
    assert plan.mapping.grid >= SM90.sms and plan.mapping.rows % plan.mapping.grid == 0
    got, expected = _run_emulated(func, plan, reference, names, rng, dtype)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for out, ref in zip(got, expected):
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(out.numpy().astype("float64") / scale, ref / scale, rtol=tol, atol=tol)


def test_row_or_column_reductions_alone_are_not_mix_order():
    x = tensor("x", (264, 128))
    rows = make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(x, x), axis=[-1])))
    columns = make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(x, x), axis=[0])))
    for mod in (rows, columns):
        with pytest.raises(MixOrderError):
            plan_mix_order(_whole_group(mod), SM90, "k")


def _modeled(mod, fusion):
    """(stitched plans, their modeled us in total) of the CUDA sm_90 build with the given grouping."""
    plans = build(mod, CUDA, stitched=True, strict=True, fusion=fusion).report.plans
    return plans, sum(p.modeled_us for p in plans)


@pytest.mark.parametrize("make", [_layernorm_backward, _rmsnorm_backward])
@pytest.mark.parametrize("shape", [(4096, 768), (1024, 4096)])
def test_norm_backward_is_mix_order_and_modeled_faster_at_bench(make, shape):
    """The fusion search takes the mix-order group at bench shapes: no more launches than the two-kernel
    plan (row-resident dx, column-split dgamma/dbeta), modeled at least 1.3x faster."""
    mod = make(*shape, "float32")[0]
    two, two_us = _modeled(mod, "greedy")
    mixed, mixed_us = _modeled(mod, "search")
    assert sorted(p.scheme for p in two) == ["column-split", "row-resident"]
    assert [p.scheme for p in mixed] == ["mix-order"]
    assert sum(p.kernels for p in mixed) <= sum(p.kernels for p in two)
    assert two_us >= 1.3 * mixed_us, (two_us, mixed_us)


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_mix_order_is_clean_under_simt(oclgrind):
    """Both kernels with SIMT semantics: the all-reduces of each row, the register partials written once
    per block, the combine's cross-thread sums; against numpy on the CPU (races and bounds: Oclgrind)."""
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    opencl_device(oclgrind)
    report = simt.check(_layernorm_backward(264, 128, "float32")[0], oclgrind=oclgrind)
    assert report.ok, str(report)
    assert [p.scheme for p in report.stitch.plans] == ["mix-order"], str(report)
    assert [k.launches for k in report.kernels] == [2], str(report)
    for kernel in report.kernels:
        assert kernel.max_error < 0.05, kernel
