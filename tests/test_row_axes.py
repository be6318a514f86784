"""Rows at axes that do not lead: BatchNorm on NCHW keeps the channel (axis 1) and reduces N, H, W."""

import numpy as np
import pytest
from tvm import relax, s_tir

import tvm_stitch
from tvm_stitch.stitch import kernel_maker
from tvm_stitch.analysis.row_alignment import analyze_rows
from tvm_stitch.analysis.row_axes import find_row_axes, rows_first
from tvm_stitch.analysis.tir_view import block_views, static_int
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.tools.build import build, cuda_launches, run_cpu
from tvm_stitch.tools.workloads import SUITE, dims

from conftest import CUDA, LLVM, make_module, opencl_device, tensor

EPS = 1e-5


def _manual_batchnorm(shape):
    """BatchNorm training forward written out: (y, mean, var) with keepdims statistics."""
    c = shape[1]
    x, g, b = tensor("x", shape), tensor("g", (1, c, 1, 1)), tensor("b", (1, c, 1, 1))

    def body(bb, x, g, b):
        op = relax.op
        mean = bb.emit(op.mean(x, axis=[0, 2, 3], keepdims=True))
        centered = bb.emit(op.subtract(x, mean))
        var = bb.emit(op.mean(op.multiply(centered, centered), axis=[0, 2, 3], keepdims=True))
        scaled = op.divide(centered, op.sqrt(op.add(var, relax.const(EPS, "float32"))))
        return relax.Tuple([bb.emit(op.add(op.multiply(scaled, g), b)), mean, var])

    return make_module([x, g, b], body)


def _tvm_batchnorm(shape, whole_tuple: bool):
    """relax.op.nn.batch_norm with training=True: its tuple returned whole, or only y."""
    c = shape[1]
    params = [tensor("x", shape)] + [tensor(n, (c,)) for n in ("g", "b", "rm", "rv")]

    def body(bb, *args):
        result = bb.emit(relax.op.nn.batch_norm(*args, axis=1, epsilon=EPS, training=True))
        return result if whole_tuple else relax.TupleGetItem(result, 0)

    return make_module(params, body)


def _stats(x):
    x64 = x.astype(np.float64)
    return x64.mean((0, 2, 3), keepdims=True), x64.var((0, 2, 3), keepdims=True)


def _inputs(rng, shape):
    x = (rng.standard_normal(shape) * 2 + 1).astype("float32")
    c = shape[1]
    return x, rng.standard_normal((1, c, 1, 1)).astype("float32"), rng.standard_normal((1, c, 1, 1)).astype("float32")


@pytest.mark.parametrize("target_kind", ["cpu", "cuda-on-cpu"])
def test_batchnorm_nchw_rows_are_channels_and_match_numpy(target_kind, rng):
    shape = (3, 16, 6, 5)
    x, g, b = _inputs(rng, shape)
    emulate = {"emulate": "cuda"} if target_kind == "cuda-on-cpu" else {}
    built = build(_manual_batchnorm(shape), LLVM, stitched=True, strict=True, **emulate)
    [plan] = built.report.plans
    assert plan.rank == 1 and plan.row_shape == ("16",) and plan.mapping.rows == 16
    assert plan.row_axes and all(positions == (1,) and factors == (0,)
                                 for name, positions, factors in plan.row_axes if name.startswith("T_"))
    y, mean, var = run_cpu(built.executable, [x, g, b])
    ref_mean, ref_var = _stats(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, (x - ref_mean) / np.sqrt(ref_var + EPS) * g + b, rtol=1e-4, atol=1e-4)


def test_batchnorm_nchw_is_one_cuda_launch_with_a_block_per_channel():
    mod = _manual_batchnorm((4, 32, 8, 8))
    report = tvm_stitch.explain(mod, CUDA, strict=True)
    [group] = report.groups
    assert group.plan.scheme == "row-resident" and group.plan.mapping.grid == 32
    assert any("rows are not the leading axes" in note for note in group.plan.notes)
    assert "row axes moved first" in report.details()
    assert cuda_launches(mod, stitched=True) == 1 < cuda_launches(mod, stitched=False)


def test_plan_with_row_axes_round_trips_through_json():
    [group] = tvm_stitch.explain(_manual_batchnorm((2, 8, 4, 4)), CUDA, strict=True).groups
    assert StitchPlan.from_json(group.plan.to_json()) == group.plan


def _planned_funcs(mod, monkeypatch) -> list:
    """The fused PrimFuncs the stitcher plans for `mod` on CUDA."""
    seen = []
    original = kernel_maker.plan_kernel
    monkeypatch.setattr(kernel_maker, "plan_kernel",
                        lambda func, spec, name: seen.append(func) or original(func, spec, name))
    tvm_stitch.explain(mod, CUDA, strict=True)
    return seen


def test_row_axes_move_the_channel_first_in_every_block(monkeypatch):
    [func] = _planned_funcs(_manual_batchnorm((2, 8, 3, 3)), monkeypatch)
    axes = find_row_axes(func)
    assert axes and all(len(positions) == 1 for _, positions, _ in axes)
    moved = rows_first(func, axes)
    assert analyze_rows(func).depth == 0 and analyze_rows(moved).depth >= 1
    assert all(static_int(view.extents[0]) == 8 for view in block_views(s_tir.Schedule(moved)))


def test_leading_rows_are_left_alone(monkeypatch):
    [func] = _planned_funcs(SUITE["layernorm"].build("float32", dims("test")), monkeypatch)
    assert analyze_rows(func).depth >= 1 and find_row_axes(func) is None


@pytest.mark.parametrize("whole_tuple", [False, True])
def test_tvm_batch_norm_stitches_and_matches_numpy_on_emulated_cuda(whole_tuple, rng):
    shape = (2, 8, 5, 3)
    mod = _tvm_batchnorm(shape, whole_tuple)
    report = tvm_stitch.explain(mod, CUDA)
    assert [g.fallback for g in report.groups] == [""] and report.groups[0].plan.row_axes
    x, g, b = _inputs(rng, shape)
    rm, rv = rng.standard_normal(8).astype("float32"), rng.random(8).astype("float32")
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    outs = run_cpu(built.executable, [x, g.ravel(), b.ravel(), rm, rv])
    mean, var = _stats(x)
    refs = [(x - mean) / np.sqrt(var + EPS) * g + b]
    if whole_tuple:  # moving statistics, momentum 0.1
        refs += [0.9 * rm + 0.1 * mean.ravel(), 0.9 * rv + 0.1 * var.ravel()]
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_few_long_channels_split_over_blocks():
    """64 channels of 8 x 48 x 48: row-split over the channel rows fills the GPU."""
    report = tvm_stitch.explain(_tvm_batchnorm((8, 64, 48, 48), False), CUDA, strict=True)
    [group] = report.groups
    assert group.plan.scheme == "row-split" and group.plan.row_axes
    assert group.plan.mapping.grid >= 2 * 132 and group.plan.kernels == 2 and group.plan.variance


def _simt_device(oclgrind: bool):
    pytest.importorskip("pyopencl")
    opencl_device(oclgrind)


def test_batchnorm_kernel_is_clean_under_oclgrind():
    _simt_device(True)
    from tvm_stitch import simt
    report = simt.check(_tvm_batchnorm((2, 8, 5, 3), True), oclgrind=True)
    assert report.kernels and report.ok, str(report)


def test_split_channels_run_in_order_on_pocl():
    """16 channels of 4 x 64 x 64: row-split over strided channel slices, the variance in the mean's pass."""
    _simt_device(False)
    from tvm_stitch import simt
    report = simt.check(_tvm_batchnorm((2, 4, 128, 128), False))
    assert [k.launches for k in report.kernels] == [2] and report.ok, str(report)


def test_one_pass_variance_is_clean_under_oclgrind():
    _simt_device(True)
    from tvm_stitch import simt
    report = simt.check(_tvm_batchnorm((1, 2, 128, 128), True), oclgrind=True)
    assert [k.launches for k in report.kernels] == [2] and report.ok, str(report)


def test_one_pass_variance_is_accurate_far_from_zero(rng):
    """Chunks shifted by their own mean: a mean of 1000 costs no precision in the variance."""
    shape = (2, 4, 128, 128)
    mod = _tvm_batchnorm(shape, True)
    x = (rng.standard_normal(shape) + 1000).astype("float32")
    c = shape[1]
    ones, zeros = np.ones(c, "float32"), np.zeros(c, "float32")
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    [plan] = built.report.plans
    assert plan.scheme == "row-split" and plan.variance
    y, _, moving_var = run_cpu(built.executable, [x, ones, zeros, zeros, zeros])
    _, var = _stats(x)
    np.testing.assert_allclose(moving_var, 0.1 * var.ravel(), rtol=1e-4)
    np.testing.assert_allclose(y, (x - x.astype(np.float64).mean((0, 2, 3), keepdims=True)) / np.sqrt(var + EPS),
                               rtol=1e-3, atol=1e-3)


def _group_norm(shape, groups):
    c = shape[1]
    params = [tensor("x", shape), tensor("gamma", (c,)), tensor("beta", (c,))]
    return make_module(params, lambda bb, x, gamma, beta: bb.emit(
        relax.op.nn.group_norm(x, gamma, beta, num_groups=groups, channel_axis=1, axes=[2, 3])))


@pytest.mark.parametrize("target_kind", ["cpu", "cuda-on-cpu"])
def test_group_norm_rows_are_batch_and_group_and_match_numpy(target_kind, rng):
    """The output reads its group's statistics at c // (C/G): its channel iterator is split,
    so the rows are (batch, group), not the batch alone."""
    shape, groups = (3, 16, 5, 4), 4
    mod = _group_norm(shape, groups)
    [group] = tvm_stitch.explain(mod, CUDA, strict=True).groups
    assert group.plan.row_shape == ("3", "4") and group.plan.mapping.grid == 12
    assert any(4 in factors for _, _, factors in group.plan.row_axes)
    x = rng.standard_normal(shape).astype("float32")
    gamma, beta = rng.standard_normal(16).astype("float32"), rng.standard_normal(16).astype("float32")
    emulate = {"emulate": "cuda"} if target_kind == "cuda-on-cpu" else {}
    built = build(mod, LLVM, stitched=True, strict=True, **emulate)
    [y] = run_cpu(built.executable, [x, gamma, beta])
    xg = x.astype(np.float64).reshape(3, groups, -1)
    ref = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + EPS)).reshape(shape)
    np.testing.assert_allclose(y, ref * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1), rtol=1e-4, atol=1e-4)


def test_group_norm_kernel_is_clean_under_oclgrind():
    _simt_device(True)
    from tvm_stitch import simt
    report = simt.check(_group_norm((2, 16, 4, 4), 4), oclgrind=True)
    assert report.kernels and report.ok, str(report)


def test_average_pool_with_rows_the_threads_do_not_divide_builds_and_matches(rng):
    """Each thread sums its outputs' 3x3 windows serially: in a register, then one store to shared
    memory (summed in shared memory under the thread predicate of 784 outputs over 256 threads,
    TVM's lowering rejected it: 'Cannot insert syncs inside condition')."""
    shape = (8, 64, 28, 28)
    mod = make_module([tensor("x", shape)], lambda bb, x: bb.emit(
        relax.op.nn.avg_pool2d(x, pool_size=(3, 3), strides=(1, 1), padding=(1, 1))))
    [group] = tvm_stitch.explain(mod, CUDA, strict=True).groups
    assert group.plan.rank == 2 and 784 % group.plan.mapping.threads
    x = rng.standard_normal(shape).astype("float32")
    [expected] = run_cpu(build(mod, LLVM, stitched=False).executable, [x])
    [out] = run_cpu(build(mod, LLVM, stitched=True, strict=True, emulate="cuda").executable, [x])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
