"""End to end: the stitch pipeline's builds match numpy (llvm) and launch one kernel per group (CUDA)."""

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch.tools.tolerance import tolerance
from tvm_stitch.tools.build import build, cuda_launches, run_cpu
from tvm_stitch.tools.launches import cuda_source, kernels_per_primfunc, primfunc_calls
from tvm_stitch.tools.workloads import SUITE, dims, reference

from conftest import CUDA, LLVM, make_module, static_shape, tensor

CASES = [(name, dtype) for name, g in SUITE.items() for dtype in g.dtypes]


@pytest.mark.parametrize("name, dtype", CASES)
def test_suite_graph_matches_numpy_on_llvm(name, dtype, rng):
    graph = SUITE[name]
    d = dims("test")
    inputs = graph.inputs(rng, dtype, d)
    built = build(graph.build(dtype, d), LLVM, stitched=True, strict=True)
    assert built.report.plans, "nothing was stitched"
    outs = run_cpu(built.executable, inputs)
    refs = reference(graph, inputs)
    rtol, atol = tolerance(dtype)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "name",
    ["layernorm", "softmax", "layernorm_softmax", "residual_layernorm", "chained_reductions",
     "rmsnorm", "attention_softmax", "layernorm_stats"],
)
def test_row_reduction_chains_are_one_cuda_kernel(name):
    mod = SUITE[name].build("float32", dims("bench"))
    assert cuda_launches(mod, stitched=True) == 1
    assert cuda_launches(mod, stitched=False) > 1


def test_cross_entropy_takes_two_cuda_kernels():
    mod = SUITE["cross_entropy"].build("float32", dims("bench"))
    assert cuda_launches(mod, stitched=True) == 2


def _transformer_block():
    x, w1, b1, w2 = tensor("x", (64, 96)), tensor("w1", (96, 192)), tensor("b1", (192,)), tensor("w2", (192, 96))
    g, b = tensor("g", (96,)), tensor("b", (96,))
    op = relax.op

    def layernorm(bb, h):
        mean = bb.emit(op.mean(h, axis=[-1], keepdims=True))
        c = bb.emit(op.subtract(h, mean))
        var = bb.emit(op.mean(op.multiply(c, c), axis=[-1], keepdims=True))
        return bb.emit(op.add(op.multiply(op.multiply(c, op.rsqrt(op.add(var, relax.const(1e-5)))), g), b))

    def body(bb, x, w1, b1, w2, g, b):
        h = layernorm(bb, x)
        u = bb.emit(op.add(op.matmul(h, w1), b1))
        act = bb.emit(op.multiply(op.multiply(u, relax.const(0.5)),
                                  op.add(op.erf(op.multiply(u, relax.const(0.7071067811865476))), relax.const(1.0))))
        y = bb.emit(op.add(op.matmul(act, w2), x))
        return layernorm(bb, y)

    def numpy_ref(x, w1, b1, w2, g, b):
        from math import erf

        def ln(h):
            m = h.mean(-1, keepdims=True)
            return (h - m) / np.sqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

        u = ln(x) @ w1 + b1
        act = 0.5 * u * (1 + np.vectorize(erf)(u / np.sqrt(2)))
        return ln(act @ w2 + x)

    return make_module([x, w1, b1, w2, g, b], body), numpy_ref


def test_transformer_block_keeps_matmuls_out_of_stitched_kernels(rng):
    mod, numpy_ref = _transformer_block()
    report = tvm_stitch.explain(mod, CUDA)
    assert report.plans
    for group in report.groups:
        assert all("compute-intensive" not in kind for kind in group.op_kinds), group
    assert any("contracts two tensors" in reason for _, reason in report.opaque)
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") for v in mod["main"].params]
    built = build(mod, LLVM, stitched=True, strict=True)
    (out,) = run_cpu(built.executable, inputs)
    np.testing.assert_allclose(out, numpy_ref(*[a.astype(np.float64) for a in inputs]), rtol=1e-3, atol=1e-3)
    assert cuda_launches(mod, stitched=True) < cuda_launches(mod, stitched=False)


def test_identical_groups_share_one_kernel(rng):
    # softmax(x), a matmul, softmax of its (64, 96) result: two groups with the same fused PrimFunc.
    x, w = tensor("x", (64, 96)), tensor("w", (96, 96))
    op = relax.op

    def softmax(bb, h):
        e = bb.emit(op.exp(op.subtract(h, op.max(h, axis=[-1], keepdims=True))))
        return bb.emit(op.divide(e, op.sum(e, axis=[-1], keepdims=True)))

    def body(bb, x, w):
        return softmax(bb, bb.emit(op.matmul(softmax(bb, x), w)))

    mod = make_module([x, w], body)
    built = build(mod, CUDA, stitched=True, strict=True)
    stitched = [gv.name_hint for gv, f in built.lowered.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and "tvm_stitch.plan" in f.attrs]
    first, second = built.report.plans
    assert first.kernel == second.kernel and stitched == [first.kernel]
    # One CUDA kernel, called twice.
    assert kernels_per_primfunc(cuda_source(built.executable), [first.kernel]) == {first.kernel: 1}
    assert primfunc_calls(built.lowered)[first.kernel] == 2
    cpu = build(mod, LLVM, stitched=True, strict=True)
    assert len({p.kernel for p in cpu.report.plans}) == 1 and len(cpu.report.plans) == 2
    xs, ws = rng.standard_normal((64, 96)).astype("float32"), rng.standard_normal((96, 96)).astype("float32")

    def np_softmax(h):
        e = np.exp(h - h.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    (out,) = run_cpu(cpu.executable, [xs, ws])
    np.testing.assert_allclose(out, np_softmax(np_softmax(xs.astype("float64")) @ ws), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_sums_accumulate_in_float32(dtype):
    # 4096 values of 1.0 then a tiny residue: an fp16 accumulator stalls at 2048.
    x = tensor("x", (8, 4096), dtype)
    mod = make_module([x], lambda bb, x: bb.emit(relax.op.sum(x, axis=[-1])))
    built = build(mod, LLVM, stitched=True, strict=True)
    import ml_dtypes  # the numpy dtype of bfloat16, a dependency of apache-tvm

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    data = np.ones((8, 4096), dtype=np_dtype)
    (out,) = run_cpu(built.executable, [data])
    np.testing.assert_allclose(out.astype(np.float64), np.full(8, 4096.0), rtol=1e-2)


@pytest.mark.parametrize("name, dtype", CASES)
def test_cuda_schedule_matches_numpy_when_run_on_the_cpu(name, dtype, rng):
    # The CUDA plan and schedule, built without thread bindings for llvm.
    graph = SUITE[name]
    d = dims("test")
    inputs = graph.inputs(rng, dtype, d)
    built = build(graph.build(dtype, d), LLVM, stitched=True, strict=True, emulate="cuda")
    assert all(plan.target == "cuda" for plan in built.report.plans)
    outs = run_cpu(built.executable, inputs)
    rtol, atol = tolerance(dtype)
    for out, ref in zip(outs, reference(graph, inputs)):
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name, most", [("layernorm_backward", 2), ("batchnorm_stats", 2), ("cross_entropy", 2)])
def test_column_and_mixed_reductions_take_at_most_two_kernels(name, most):
    mod = SUITE[name].build("float32", dims("bench"))
    assert cuda_launches(mod, stitched=True) <= most < cuda_launches(mod, stitched=False) + 1


def test_adam_over_a_dozen_tensors_takes_at_most_three_launches():
    mod = SUITE["adam_update"].build("float32", dims("bench"))
    assert cuda_launches(mod, stitched=False) == 36
    assert cuda_launches(mod, stitched=True) <= 3
    report = tvm_stitch.explain(mod, CUDA)
    assert report.packs and all(len(members) > 1 for _, members in report.packs)


@pytest.mark.parametrize("name", ["softmax", "cross_entropy"])
@pytest.mark.parametrize("target_kind", ["cpu", "cuda-on-cpu"])
def test_softmax_and_log_sum_exp_stay_finite_near_1e4(name, target_kind, rng):
    graph = SUITE[name]
    d = dims("test")
    inputs = graph.inputs(rng, "float32", d)
    inputs[0] = (np.sign(inputs[0]) * 1e4 + inputs[0]).astype("float32")
    emulate = "cuda" if target_kind == "cuda-on-cpu" else None
    built = build(graph.build("float32", d), LLVM, stitched=True, strict=True, emulate=emulate)
    outs = run_cpu(built.executable, inputs)
    for out, ref in zip(outs, reference(graph, inputs)):
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-4, atol=1e-5)


def test_float16_graphs_match_numpy_on_this_cpu(rng):
    # The host CPU target: with F16C (x86) float16 rows are vectorised, not converted lane by lane.
    from tvm_stitch.target import host_target

    d = dims("test")
    for name, graph in SUITE.items():
        if "float16" not in graph.dtypes:
            continue
        inputs = graph.inputs(rng, "float16", d)
        built = build(graph.build("float16", d), host_target(), stitched=True, strict=True)
        rtol, atol = tolerance("float16")
        for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, inputs)):
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("name", ["softmax", "layernorm_softmax", "bias_gelu"])
def test_float16_graphs_compute_in_float32_on_the_cpu(name):
    # The CPU has no float16 arithmetic: a stitched float16 chain reads and writes float16 once and
    # keeps every intermediate (reduction results, per-row buffers) in float32.
    built = build(SUITE[name].build("float16", dims("test")), LLVM, stitched=True, strict=True)
    stitched = [f for f in built.lowered.functions.values()
                if isinstance(f, tvm.tirx.PrimFunc) and "tvm_stitch.plan" in f.attrs]
    assert stitched
    for func in stitched:
        sch = tvm.s_tir.Schedule(func)
        buffers = sch.get(sch.get_sblock("root")).alloc_buffers
        assert all(str(b.dtype) == "float32" for b in buffers), [(b.name, str(b.dtype)) for b in buffers]
        tensors = [p for p in func.params if len(p.shape) > 0]  # scalars are folded constants
        assert {str(p.dtype) for p in tensors} == {"float16"}


def test_cpu_packs_only_kernels_with_tasks_of_about_one_size(rng):
    # The CPU thread pool splits a parallel loop's tasks evenly by count: rows of 1024 elements packed
    # with rows of 8 would leave one core with most of the work.
    shapes = [(64, 1024), (32, 1024), (2048, 8)]
    xs = [tensor(f"x{i}", s) for i, s in enumerate(shapes)]

    def body(bb, *xs):
        return relax.Tuple([bb.emit(relax.op.multiply(relax.op.exp(x), x)) for x in xs])

    built = build(make_module(xs, body), LLVM, stitched=True, strict=True)
    assert len(built.report.packs) == 1
    (_, members), = built.report.packs
    assert len(members) == 2
    inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
    for out, x in zip(run_cpu(built.executable, inputs), inputs):
        np.testing.assert_allclose(out, np.exp(x) * x, rtol=1e-5, atol=1e-6)
