"""A group the planner cannot handle falls back to TVM's default path, with a reason, and stays correct."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvm_stitch
from tvm_stitch.stitch import block_rewriter, kernel_maker
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
    # A shared buffer of symbolic size: no row-resident plan, and no row-split plan of a symbolic row.
    assert all(group.reason.code == "no-scheme" and group.stage == "outlined" for group in report.fallbacks), \
        report.table()
    for group in report.fallbacks:
        resident, split = group.reason.params["row_resident"], group.reason.params["row_split"]
        assert (resident.code, split.code) == ("symbolic-shared-buffer", "split-symbolic-length"), group.fallback
        assert group.fallback == group.reason.text and "symbolic length" in group.fallback
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


def _row_sums_then_middle_axis_sum():
    """Reductions over rows of 16 then over a middle axis of 1000: the first schedule tried for
    such shapes put a barrier under a thread predicate (TVM's lowering rejected it)."""
    x = tensor("x", (2, 1000, 16))

    def body(bb, x):
        inner = bb.emit(op.sum(x, axis=[2], keepdims=True))
        return bb.emit(op.sum(op.multiply(x, inner), axis=[1]))

    return make_module([x], body)


def _check_row_sums_then_middle_axis_sum(mod, **build_options):
    built = build(mod, LLVM, stitched=True, **build_options)
    data = np.random.default_rng(0).standard_normal((2, 1000, 16)).astype("float32")
    (out,) = run_cpu(built.executable, [data])
    ref = (data * data.sum(2, keepdims=True)).sum(1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)


def test_group_whose_schedule_fails_to_build_falls_back(monkeypatch):
    def failing_build(func, target):
        raise tvm.error.InternalError("Cannot insert syncs inside condition")

    monkeypatch.setattr(kernel_maker, "check_builds", failing_build)
    mod = _row_sums_then_middle_axis_sum()
    report = tvm_stitch.StitchReport()
    tvm.compile(mod, target=CUDA, relax_pipeline=tvm_stitch.pipeline(CUDA, report=report))
    (group,) = report.groups
    assert not group.stitched and group.stage == "planned", report.table()
    assert group.reason.code == "error" and group.reason.params["type"] == "InternalError", group.fallback
    _check_row_sums_then_middle_axis_sum(mod)


def test_row_sums_then_a_middle_axis_sum_now_stitch_on_cuda():
    """Its in-thread sums accumulate in registers (schedules/cuda/row_resident.py): the one group greedy
    forms builds. The fusion search (the default) prefers two kernels, the multiply computed again in the
    second: 2 x 1000 rows of 16 make a one-kernel plan with few threads, slower under the time model."""
    mod = _row_sums_then_middle_axis_sum()
    report = tvm_stitch.explain(mod, CUDA, strict=True, fusion="greedy")
    assert [(g.stitched, g.stage) for g in report.groups] == [(True, "scheduled")]
    _check_row_sums_then_middle_axis_sum(mod, strict=True, emulate="cuda", fusion="greedy")
    searched = tvm_stitch.explain(mod, CUDA, strict=True)
    assert [(g.ops, g.recomputed) for g in searched.groups] == [(("sum",), ()), (("sum1",), ("multiply",))]
    assert sum(p.modeled_us for p in searched.plans) < 0.75 * report.plans[0].modeled_us
    _check_row_sums_then_middle_axis_sum(mod, strict=True, emulate="cuda")


def _exp_and_two_row_sums():
    """exp(x) (an output, also summed) over 16 rows of 20000, and a sum over rows of 10000 of w."""
    x, w = tensor("x", (16, 20000)), tensor("w", (16, 10000))

    def body(bb, x, w):
        ex = bb.emit(op.exp(x))
        total = bb.emit(op.add(op.sum(ex, axis=[1], keepdims=True), op.sum(w, axis=[1], keepdims=True)))
        return relax.Tuple([ex, total])

    return make_module([x, w], body)


def test_split_group_that_cannot_be_stitched_is_retried_in_parts(rng):
    # Few long rows: the partition keeps the four ops together for row-split; row-split refuses two
    # row lengths and the 80 KB rows of exp do not fit shared memory, so the parts that keep rows on
    # chip are stitched instead.
    mod = _exp_and_two_row_sums()
    report = tvm_stitch.explain(mod, CUDA)
    assert [g.ops for g in report.groups] == [("tir_exp",), ("sum", "sum1", "add")]
    assert all(g.stitched for g in report.groups)
    (note,) = [n for n in report.notes if "stitched as 2 groups" in n]
    assert "exceed 49152 of shared memory" in note and "blocks differ in row length" in note
    built = build(mod, LLVM, stitched=True, emulate="cuda")  # strict mode raises before trying parts
    assert len(built.report.plans) == 2 and not built.report.fallbacks
    x = rng.uniform(-1, 1, (16, 20000)).astype("float32")
    w = rng.uniform(-1, 1, (16, 10000)).astype("float32")
    ex, total = run_cpu(built.executable, [x, w])
    np.testing.assert_allclose(ex, np.exp(x), rtol=1e-5)
    want = np.exp(x.astype("float64")).sum(1, keepdims=True) + w.sum(1, keepdims=True)
    np.testing.assert_allclose(total, want, rtol=1e-4)


def test_kernels_stay_apart_when_their_packed_kernel_does_not_build(monkeypatch, rng):
    from tvm_stitch.tools.workloads import SUITE, dims, reference

    graph = SUITE["adam_update"]
    mod = graph.build("float32", dims("test"))
    packed = build(mod, LLVM, stitched=True, strict=True)
    assert packed.report.packs
    original = block_rewriter.check_builds

    def refuse_packs(func, target):
        if "tvm_stitch.packed" in func.attrs:
            raise RuntimeError("injected: the packed kernel does not build")
        original(func, target)

    monkeypatch.setattr(block_rewriter, "check_builds", refuse_packs)
    apart = build(mod, LLVM, stitched=True)
    assert not apart.report.packs and len(apart.report.plans) == len(packed.report.plans)
    assert any("left unpacked" in n and "injected" in n for n in apart.report.notes)
    inputs = graph.inputs(rng, "float32", dims("test"))
    for out, ref in zip(run_cpu(apart.executable, inputs), reference(graph, inputs)):
        np.testing.assert_allclose(out.astype("float64"), ref, rtol=2e-4, atol=2e-4)


def test_exponentially_growing_inlined_chain_falls_back_with_reason(rng):
    """Each value read three times by the next: inlined whole, the last block's expression would
    hold 3^12 copies of x's. The planners refuse to inline it (s_tir would take minutes) and the group
    keeps TVM's path, right."""
    x = tensor("x", (64, 3))

    def body(bb, x):
        v = x
        for _ in range(12):
            v = bb.emit(op.add(op.multiply(v, op.tanh(v)), op.multiply(v, relax.const(0.5, "float32"))))
        return v

    mod = make_module([x], body)
    report = tvm_stitch.explain(mod, CUDA)
    assert report.fallbacks and not report.plans, report.table()
    assert "grows its expression" in report.fallbacks[0].fallback, report.fallbacks[0].fallback
    built = build(mod, LLVM, stitched=True, emulate="cuda")
    a = rng.standard_normal((64, 3)).astype("float32")
    want = a.astype("float64")
    for _ in range(12):
        want = want * np.tanh(want) + 0.5 * want
    (got,) = run_cpu(built.executable, [a])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
