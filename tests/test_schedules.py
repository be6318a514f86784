"""What the row-resident schedules guarantee: expensive ops once, on-chip reuse within limits."""

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.tolerance import tolerance
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.tools.workloads import SUITE, dims, reference
from tvm_stitch.analysis.tir_view import expensive_ops

from conftest import CUDA, LLVM, make_module, tensor


def _stitched_funcs(name, target):
    built = build(SUITE[name].build("float32", dims("bench")), target, stitched=True, strict=True)
    return [f for _, f in built.lowered.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and "tvm_stitch.plan" in f.attrs]


def _source_counts(name):
    from tvm import relax

    mod = relax.transform.LegalizeOps()(SUITE[name].build("float32", dims("bench")))
    counts = {}
    for _, f in mod.functions_items():
        if isinstance(f, tvm.tirx.PrimFunc):
            for op in expensive_ops(f.body):
                counts[op] = counts.get(op, 0) + 1
    return counts


def test_expensive_ops_are_not_recomputed():
    for name in ("layernorm_softmax", "softmax", "bias_gelu", "cross_entropy"):
        source = _source_counts(name)
        for target in (CUDA, LLVM):
            counts = {}
            for f in _stitched_funcs(name, target):
                for op in expensive_ops(f.body):
                    counts[op] = counts.get(op, 0) + 1
            for op in ("exp", "erf", "rsqrt", "log"):
                assert counts.get(op, 0) <= source.get(op, 0), (name, target.kind.name, op, counts, source)


def test_cuda_plan_fits_shared_memory_and_binds_threads():
    (func,) = _stitched_funcs("layernorm_softmax", CUDA)
    plan = StitchPlan.from_json(str(func.attrs["tvm_stitch.plan"]))
    assert 0 < plan.shared_bytes <= plan.spec.shared_bytes_per_block == 48 * 1024
    bound = set()

    def on_for(loop):
        if loop.thread_binding is not None:
            bound.add(str(loop.thread_binding.thread_tag))

    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, on_for), order="pre")
    assert bound == {"blockIdx.x", "threadIdx.x"}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_packed_over_several_axes_match_numpy_without_thread_bindings(dtype, rng):
    """4 rows of (2, 3, 128) per block: the on-chip buffers take one fused row axis (CUDA schedule
    run on the CPU)."""
    graph, size = SUITE["attention_softmax"], {**dims("test"), "seq": 128}
    inputs = graph.inputs(rng, dtype, size)
    built = build(graph.build(dtype, size), LLVM, stitched=True, strict=True, emulate="cuda")
    (plan,) = built.report.plans
    assert plan.target == "cuda" and plan.rank == 3 and plan.mapping.rows_per_task > 1
    rtol, atol = tolerance(dtype)
    for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, inputs)):
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)


def test_row_resident_kernels_move_the_ideal_bytes():
    from tvm_stitch import TargetSpec
    from tvm_stitch.pricing.traffic import modeled_traffic

    for name in ("layernorm", "layernorm_stats", "rmsnorm", "softmax", "attention_softmax", "bias_gelu",
                 "residual_layernorm", "layernorm_softmax", "chained_reductions"):
        for func in _stitched_funcs(name, CUDA):
            traffic = modeled_traffic(func, TargetSpec.from_target(CUDA))
            assert traffic.total == traffic.ideal, (name, traffic)


def test_traffic_model_counts_rereads():
    from tvm_stitch.tools.launches import program_traffic

    mod = SUITE["layernorm"].build("float32", dims("bench"))
    default = build(mod, CUDA, stitched=False)
    modeled, ideal = program_traffic(default.lowered, CUDA)
    # TVM's default: three kernels, x read in several passes, intermediates round-trip.
    assert modeled > 3 * ideal


def test_cpu_column_reductions_stream_adjacent_rows_in_vector_lanes():
    # dgamma and dbeta reduce over rows: a task takes adjacent columns, vectorised, and walks the rows
    # once for both sums (contiguous loads), instead of a strided walk per column.
    streamed = [(f, StitchPlan.from_json(str(f.attrs["tvm_stitch.plan"])))
                for f in _stitched_funcs("layernorm_backward", LLVM)]
    streamed = [(f, p) for f, p in streamed if p.mapping.rows_per_task > 1]
    assert len(streamed) == 1
    func, plan = streamed[0]
    assert plan.mapping.grid * plan.mapping.rows_per_task == plan.mapping.rows == 768
    walks, vectorized = [], []

    def on_for(loop):
        if loop.kind == tvm.tirx.ForKind.VECTORIZED:
            vectorized.append(int(loop.extent))
        elif loop.kind == tvm.tirx.ForKind.SERIAL and int(loop.extent) == 4096:
            walks.append(loop)
            # Inside the walk: the task's rows, as vectors of the plan's width (a loop of them
            # when the task holds more rows than one vector).
            inner = loop.body
            while isinstance(inner, tvm.tirx.For) and inner.kind == tvm.tirx.ForKind.SERIAL:
                inner = inner.body
            assert isinstance(inner, tvm.tirx.For) and inner.kind == tvm.tirx.ForKind.VECTORIZED

    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, on_for), order="pre")
    lanes = min(plan.mapping.vector, plan.mapping.rows_per_task)
    assert len(walks) == 1 and vectorized == [lanes]


def test_cpu_rows_hold_one_reduction_each_so_reductions_use_vector_lanes():
    # attention scores 8x12x128x128: rows of 128 (12288 of them), not 96 rows of 128 reductions each,
    # and every reduction is split into vector lanes (an rfactor block per reduction).
    (func,) = _stitched_funcs("attention_softmax", LLVM)
    plan = StitchPlan.from_json(str(func.attrs["tvm_stitch.plan"]))
    assert plan.rank == 3 and plan.mapping.rows == 8 * 12 * 128
    names = []
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda b: names.append(b.name_hint)), order="pre")
    assert sum(n.endswith("_rf") for n in names) == plan.reductions == 2


def test_cpu_long_column_sums_are_cut_into_parallel_partials(rng):
    # 10001 rows: more than one chunk of 4096, not a multiple of the chunk count (a partial last chunk).
    import numpy as np
    from tvm import relax

    from tvm_stitch.tools.build import run_cpu

    x, y = tensor("x", (10001, 48)), tensor("y", (10001, 48))
    mod = make_module([x, y], lambda bb, x, y: relax.Tuple([
        bb.emit(relax.op.sum(relax.op.multiply(x, y), axis=[0])), bb.emit(relax.op.sum(x, axis=[0]))]))
    built = build(mod, LLVM, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.mapping.rows_per_task > 1 and plan.mapping.split == 3
    a, b = rng.standard_normal((10001, 48)).astype("float32"), rng.standard_normal((10001, 48)).astype("float32")
    dot, total = run_cpu(built.executable, [a, b])
    np.testing.assert_allclose(dot, (a.astype("float64") * b).sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(total, a.astype("float64").sum(0), rtol=1e-4, atol=1e-3)


def test_cpu_few_long_rows_are_cut_into_chunks_over_the_cores(rng):
    # Two rows of 65536 for four cores: each row in 8 chunks of 8192, every block a parallel loop,
    # max and sum as per-chunk partials, then combined.
    import numpy as np
    from tvm import relax

    import dataclasses

    from tvm_stitch import TargetSpec
    from tvm_stitch.tools.build import run_cpu

    four_cores = dataclasses.replace(TargetSpec.from_target(LLVM), cores=4)
    x = tensor("x", (2, 65536))

    def softmax(bb, x):
        e = bb.emit(relax.op.exp(relax.op.subtract(x, relax.op.max(x, axis=[-1], keepdims=True))))
        return bb.emit(relax.op.divide(e, relax.op.sum(e, axis=[-1], keepdims=True)))

    built = build(make_module([x], softmax), LLVM, stitched=True, strict=True, spec=four_cores)
    (plan,) = built.report.plans
    assert plan.mapping.split == 8 and plan.spec == four_cores
    (func,) = [f for f in built.lowered.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and "tvm_stitch.plan" in f.attrs]
    parallel = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, lambda l: parallel.append(int(l.extent))
                                        if l.kind == tvm.tirx.ForKind.PARALLEL else None), order="pre")
    assert parallel and all(extent == 2 * 8 for extent in parallel)
    data = rng.standard_normal((2, 65536)).astype("float32") * 4
    (out,) = run_cpu(built.executable, [data])
    e = np.exp(data.astype("float64") - data.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-9)


def test_planner_demotes_an_expensive_intermediate_whose_row_exceeds_shared_memory(rng):
    # One softmax group over rows of 16384 (64 KB of exp per row): the partition would cut it at
    # shared memory, so the fused PrimFunc is made here and planned directly.
    import dataclasses

    import numpy as np
    from tvm import relax

    from conftest import fused
    from schedules import schedule_for
    from tvm_stitch import TargetSpec
    from tvm_stitch.analysis.graph import analyses_for, build_graph
    from tvm_stitch.kernels.builds import check_builds
    from tvm_stitch.kernels.outline import outline_group
    from tvm_stitch.grouping.partition import partition
    from tvm_stitch.planning.limits import partition_limits
    from tvm_stitch.planning.planner import SharedMemoryError, plan_kernel, plan_row_resident

    x = tensor("x", (256, 16384))

    def softmax(bb, x):
        e = bb.emit(relax.op.exp(relax.op.subtract(x, relax.op.max(x, axis=[-1], keepdims=True))))
        return bb.emit(relax.op.divide(e, relax.op.sum(e, axis=[-1], keepdims=True)))

    mod = fused(make_module([x], softmax))
    (block,) = mod["main"].body.blocks
    graph = build_graph(mod, block, set(relax.analysis.free_vars(mod["main"].body.body)), analyses_for(mod))
    spec = TargetSpec.from_target(CUDA)
    (members,) = partition(graph, dataclasses.replace(partition_limits(spec), row_bytes_limit=1 << 30))
    func = outline_group(mod, graph, members, "softmax").func
    with pytest.raises(SharedMemoryError) as err:
        plan_row_resident(func, spec, "softmax")  # exp's 64 KB row kept on chip
    assert err.value.code == "shared-memory-exceeded" and err.value.params["limit"] == 49152
    assert err.value.params["bytes"] > 16384 * 4
    exp = err.value.demotable[0]
    plan = plan_kernel(func, spec, "softmax")
    (demoted,) = [i for i in plan.intermediates if i.name == exp]
    assert demoted.inlined and "demoted from shared memory" in demoted.why
    assert plan.scheme == "row-resident" and plan.shared_bytes <= spec.shared_bytes_per_block
    scheduled = schedule_for(func, plan, CUDA).mod["main"]
    check_builds(scheduled.with_attr("tirx.is_scheduled", True), CUDA)

    emulated = schedule_for(func, plan, LLVM).mod["main"].with_attr("global_symbol", "softmax")
    lib = tvm.tirx.build(tvm.IRModule({"softmax": emulated}), target=LLVM)
    data = rng.standard_normal((256, 16384)).astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(data))
    lib["softmax"](tvm.runtime.tensor(data), out)
    e = np.exp(data.astype("float64") - data.max(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-9)


def test_last_resort_schedule_uses_the_targets_thread_limit():
    from tvm import relax

    from schedules.cuda import per_block
    from tvm_stitch import TargetSpec
    from tvm_stitch.kernels.builds import check_builds

    mod = relax.transform.LegalizeOps()(make_module([tensor("x", (64, 96))],
                                                    lambda bb, x: bb.emit(relax.op.sum(x, axis=[1]))))
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    for limit, threads in ((1024, 256), (128, 128)):
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": limit})
        scheduled = per_block.apply(func, TargetSpec.from_target(target)).mod["main"]
        extents = []
        tvm_ffi.structural_walk(scheduled.body, (tvm.tirx.For, lambda l: extents.append(int(l.extent))
                                                 if l.thread_binding is not None
                                                 and l.thread_binding.thread_tag == "threadIdx.x" else None),
                                order="pre")
        assert extents == [threads]
        check_builds(scheduled, target)
