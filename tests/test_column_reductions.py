"""Column reductions (sums over leading or middle axes) on CUDA: column-split.

Numerics: the CUDA schedule built for llvm without thread bindings (emulated
CUDA) against numpy, at small shapes; SIMT semantics on pocl and Oclgrind in
tests/test_simt.py style; nvcc for sm_90 without spills. Thread counts are read
from the scheduled TIR at bench-like shapes (built, not run).
"""

import re

import numpy as np
import pytest
import tvm_ffi
from tvm import relax, tirx

from tvm_stitch.planning.cuda.fill import fill_threads
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.workloads import SIZES, SUITE, reference

from conftest import CUDA, LLVM, NVCC, make_module, needs_nvcc, nvcc, opencl_device, tensor

SM90 = TargetSpec.from_target(CUDA)
op = relax.op


def _column_sum(rows, cols):
    x = tensor("x", (rows, cols))
    return make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(op.exp(x), x), axis=[0]))), \
        lambda a: (np.exp(a) * a).sum(axis=0)


def _column_mean(rows, cols):
    x, b = tensor("x", (rows, cols)), tensor("b", (cols,))
    return make_module([x, b], lambda bb, x, b: bb.emit(op.mean(op.add(x, b), axis=[0]))), \
        lambda a, c: (a + c).mean(axis=0)


def _middle_sum(batch, rows, cols):
    x = tensor("x", (batch, rows, cols))
    return make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(x, x), axis=[1]))), \
        lambda a: (a * a).sum(axis=1)


def _bias_grad(rows, cols):
    """A bias gradient as the torch importer writes it: a kept unit axis, then a reshape."""
    x = tensor("x", (rows, cols))
    return make_module([x], lambda bb, x: bb.emit(op.reshape(op.sum(x, axis=[0], keepdims=True), (cols,)))), \
        lambda a: a.sum(axis=0)


def _inputs(mod, rng):
    return [rng.uniform(-1, 1, [int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]


def _emulated(mod, ref, rng):
    inputs = _inputs(mod, rng)
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    (out,) = run_cpu(built.executable, inputs)
    np.testing.assert_allclose(out, ref(*[i.astype("float64") for i in inputs]), rtol=1e-4, atol=1e-4)
    return built.report.plans


@pytest.mark.parametrize("make,shape", [(_column_sum, (256, 96)), (_column_mean, (512, 64)),
                                        (_middle_sum, (2, 128, 48)), (_column_sum, (16384, 16)),
                                        (_bias_grad, (256, 96))])
def test_column_split_matches_numpy_emulated(make, shape, rng):
    mod, ref = make(*shape)
    (plan,) = _emulated(mod, ref, rng)
    assert plan.scheme == "column-split"
    assert plan.mapping.rows_per_task > 1 and plan.threads_per_block >= SM90.warp_size


def test_layernorm_backward_dgamma_dbeta_match_numpy_emulated():
    graph = SUITE["layernorm_backward"]
    dims = SIZES["test"]
    inputs = graph.inputs(np.random.default_rng(1), "float32", dims)
    built = build(graph.build("float32", dims), LLVM, stitched=True, strict=True, emulate="cuda")
    for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, [i.astype("float64") for i in inputs])):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert [p.scheme for p in built.report.plans].count("column-split") == 1


def _kernel_threads(func: tirx.PrimFunc) -> list:
    """Threads (blocks x threads per block) of each kernel (root loop nest) of a scheduled PrimFunc."""
    root = func.body.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    out = []
    for nest in nests:
        extents = {}

        def visit(loop, extents=extents):
            if loop.kind == tirx.ForKind.THREAD_BINDING:
                extents[loop.thread_binding.thread_tag] = int(loop.extent)

        tvm_ffi.structural_walk(nest, (tirx.For, visit), order="pre")
        if extents:  # statements beside the kernels (a one-launch rewrite's) bind no threads
            out.append(int(np.prod(list(extents.values()))))
    return out


def _cuda_threads(mod):
    """(launches, [(modeled bytes, threads of its kernels)] per stitched PrimFunc) of the CUDA build."""
    built = build(mod, CUDA, stitched=True, strict=True)
    kernels = []
    for gv, func in built.lowered.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and "tvm_stitch.plan" in func.attrs:
            plan = built.report.plans[[p.kernel for p in built.report.plans].index(gv.name_hint)]
            kernels.append((plan, _kernel_threads(func)))
    return count_launches(built.lowered, built.executable), kernels


@pytest.mark.parametrize("make,shape,launches", [
    (_column_sum, (4096, 1024), 1), (_column_mean, (4096, 768), 1), (_middle_sum, (2, 1024, 1024), 1),
    (_column_sum, (750000, 32), 2)])
def test_column_kernels_over_8mb_launch_64k_threads(make, shape, launches):
    mod, _ = make(*shape)
    count, kernels = _cuda_threads(mod)
    assert count == launches
    (plan, threads), = kernels
    assert plan.scheme == "column-split" and plan.modeled_bytes >= 8 << 20
    assert threads[0] >= 1 << 16 and threads[0] >= fill_threads(SM90) * 0.9


def test_layernorm_backward_bench_is_one_launch_and_fills_the_gpu():
    """Before: dgamma/dbeta walked 768 columns with 768 threads (24 blocks x 32); then a column-split
    kernel beside dx's; then one mix-order group of two launches (partials, their combine); now the
    combine is in the same launch, behind the arrival counters (tests/test_mix_order.py)."""
    count, kernels = _cuda_threads(SUITE["layernorm_backward"].build("float32", SIZES["bench"]))
    assert count == 1
    for plan, threads in kernels:
        if plan.modeled_bytes >= 8 << 20:
            assert min(threads) >= 1 << 16, (plan.kernel, threads)
    assert [p.scheme for p, _ in kernels] == ["mix-order"]


def test_short_rows_variant_is_two_launches_with_a_combine():
    """750000 rows of 32: was three launches (dx, column-split partials, their combine); the mix-order
    group is two (dx with the partials, the combine)."""
    count, kernels = _cuda_threads(SUITE["layernorm_backward_short_rows"].build("float32", SIZES["bench"]))
    assert count == 2
    (plan, threads), = kernels
    assert plan.scheme == "mix-order" and plan.kernels == 2 and threads[0] >= 1 << 16


def test_row_reductions_are_not_column_split(rng):
    x = tensor("x", (256, 96))
    mod = make_module([x], lambda bb, x: bb.emit(op.sum(x, axis=[1])))
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    assert built.report.plans[0].scheme != "column-split"


def _no_spills(source: str, tmp_path) -> None:
    """nvcc compiles `source` for sm_90 and ptxas reports no spill of any kernel."""
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(source, tmp_path))]
    assert spills and max(spills) == 0


@needs_nvcc
@pytest.mark.parametrize("make,shape", [(_column_mean, (4096, 768)), (_column_sum, (750000, 32)),
                                        (_middle_sum, (2, 1024, 1024))])
def test_column_split_compiles_with_nvcc_without_spills(make, shape, tmp_path):
    mod, _ = make(*shape)
    # The rule plans, which load 128 bits where the columns divide (the time model may choose scalar loads).
    built = build(mod, CUDA, stitched=True, strict=True, cost_model=False)
    source = cuda_source(built.executable)
    assert "float4" in source
    _no_spills(source, tmp_path)


def _simt(mod, oclgrind: bool):
    cl = pytest.importorskip("pyopencl")
    del cl
    from tvm_stitch import simt
    opencl_device(oclgrind)
    report = simt.check(mod, oclgrind=oclgrind)
    assert report.ok, str(report)
    assert any(p.scheme == "column-split" for p in report.stitch.plans), str(report)
    return report


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
@pytest.mark.parametrize("make,shape,launches", [(_column_mean, (256, 32), 1), (_middle_sum, (2, 64, 16), 1),
                                                 (_column_sum, (8192, 8), 2), (_column_sum, (12000, 8), 2)])
def test_column_split_is_clean_under_simt(make, shape, launches, oclgrind):
    """Row threads reduce in shared memory (12000 rows: 500 row threads, not a power of two); with a
    split, the partials kernel runs before the combine."""
    report = _simt(make(*shape)[0], oclgrind=oclgrind)
    assert [k.launches for k in report.kernels] == [launches], str(report)
    for kernel in report.kernels:
        assert kernel.max_error < 0.05, kernel


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_layernorm_backward_is_clean_under_simt(oclgrind):
    _simt(SUITE["layernorm_backward"].build("float32", SIZES["test"]), oclgrind=oclgrind)


def _scalar_mean(rows, cols):
    x = tensor("x", (rows, cols))
    return make_module([x], lambda bb, x: bb.emit(op.mean(op.multiply(x, x)))), lambda a: (a * a).mean()


def _global_norm(rows, cols):
    x = tensor("x", (rows, cols))
    return make_module([x], lambda bb, x: bb.emit(op.sqrt(op.sum(op.multiply(x, x))))), \
        lambda a: np.sqrt((a * a).sum())


@pytest.mark.parametrize("make", [_scalar_mean, _global_norm])
def test_whole_tensor_reduction_with_its_producer_matches_numpy_emulated(make, rng):
    """Over WHOLE_TENSOR_MIN elements: producer, reduction and scalar epilogue in one PrimFunc,
    partials over blocks, one combining block."""
    mod, ref = make(1024, 1024)
    (plan,) = _emulated(mod, ref, rng)
    assert plan.scheme == "column-split" and plan.kernels == 2 and plan.rank == 0
    assert len(plan.ops) >= 3  # the producer is in the group


@pytest.mark.parametrize("make", [_scalar_mean, _global_norm])
def test_whole_tensor_reduction_takes_two_launches_with_64k_threads(make):
    """Before: the mean fell back (no row axis, 8M elements in one row task): 3 launches, its
    reduction in a single-thread kernel."""
    count, kernels = _cuda_threads(make(4096, 2048)[0])
    assert count == 2
    (plan, threads), = kernels
    assert plan.modeled_bytes >= 8 << 20 and threads[0] >= 1 << 16 and threads[1] == plan.mapping.split


def test_small_whole_tensor_reduction_keeps_one_block():
    count, kernels = _cuda_threads(_scalar_mean(64, 96)[0])
    assert count == 1 and kernels[0][0].scheme == "row-resident"


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_whole_tensor_reduction_is_clean_under_simt(oclgrind, monkeypatch):
    """At a small size, with the threshold lowered so that the two-kernel plan is taken."""
    from tvm_stitch.planning.cuda import column_split
    monkeypatch.setattr(column_split, "WHOLE_TENSOR_MIN", 1 << 12)
    report = _simt(_global_norm(64, 128)[0], oclgrind=oclgrind)
    assert [k.launches for k in report.kernels] == [2], str(report)


N = tirx.Var("n", "int64")


def _cross_entropy(rows, vocab):
    logits, labels = tensor("logits", (rows, vocab)), tensor("labels", (rows,), "int64")

    def body(bb, logits, labels):
        mx = bb.emit(op.max(logits, axis=[-1], keepdims=True))
        shifted = bb.emit(op.subtract(logits, mx))
        lse = bb.emit(op.log(op.sum(op.exp(shifted), axis=[-1], keepdims=True)))
        return bb.emit(op.nn.nll_loss(op.subtract(shifted, lse), labels, reduction="mean"))

    return make_module([logits, labels], body)


def test_symbolic_cross_entropy_takes_two_launches_like_the_static_build(rng):
    """The mean over a symbolic row count is one streaming block (it fell back to single-thread
    kernels: 4 launches)."""
    static = build(_cross_entropy(4096, 8192), CUDA, stitched=True)
    symbolic = build(_cross_entropy(N, 8192), CUDA, stitched=True)
    assert not symbolic.report.fallbacks, symbolic.report.details()
    assert count_launches(symbolic.lowered, symbolic.executable) == 2 == count_launches(static.lowered,
                                                                                          static.executable)
    emulated = build(_cross_entropy(N, 200), LLVM, stitched=True, emulate="cuda")
    assert not emulated.report.fallbacks
    for rows in (1, 37, 300):
        logits = rng.standard_normal((rows, 200)).astype("float32")
        labels = rng.integers(0, 200, rows).astype("int64")
        (out,) = run_cpu(emulated.executable, [logits, labels])
        shifted = logits.astype("float64") - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        np.testing.assert_allclose(out, -logp[np.arange(rows), labels].mean(), rtol=1e-5, atol=1e-6)


@needs_nvcc
def test_whole_tensor_and_symbolic_mean_compile_with_nvcc(tmp_path):
    for mod in [_global_norm(4096, 2048)[0], _cross_entropy(N, 8192)]:
        _no_spills(cuda_source(build(mod, CUDA, stitched=True, strict=True).executable), tmp_path)


def test_dgamma_reading_per_row_statistics_is_column_split(rng):
    """dgamma = sum over rows of dy * (x - mean) * rstd with mean, rstd of shape (rows, 1): their
    reads are the same for every column of a row."""
    x, dy, mean, rstd = (tensor("x", (512, 64)), tensor("dy", (512, 64)), tensor("mean", (512, 1)),
                         tensor("rstd", (512, 1)))
    mod = make_module([x, dy, mean, rstd], lambda bb, x, dy, m, r: bb.emit(
        op.sum(op.multiply(dy, op.multiply(op.subtract(x, m), r)), axis=[0])))
    (plan,) = _emulated(mod, lambda a, d, m, r: (d * (a - m) * r).sum(axis=0), rng)
    assert plan.scheme == "column-split"


def _independent_sums(rows):
    a, b = tensor("a", (rows, 768)), tensor("b", (rows, 3072))
    return make_module([a, b], lambda bb, a, b: relax.Tuple([
        bb.emit(op.sum(a, axis=[0])), bb.emit(op.sum(b, axis=[0])), bb.emit(op.sum(op.multiply(a, a), axis=[0]))]))


def test_independent_column_sums_share_one_launch(rng, tmp_path):
    """Column sums that packing puts in one launch (bias gradients of a backward step): column-split
    kernels of one block shape are packed together, so the launch count stays that of the packed
    thread-per-column walks, with their threads."""
    built = build(_independent_sums(1024), CUDA, stitched=True, strict=True)
    assert count_launches(built.lowered, built.executable) == 1 and len(built.report.packs) == 1
    assert all(p.scheme == "column-split" for p in built.report.plans)
    x, y = (rng.uniform(-1, 1, s).astype("float32") for s in ((1024, 768), (1024, 3072)))
    emulated = build(_independent_sums(1024), LLVM, stitched=True, strict=True, emulate="cuda")
    for out, ref in zip(run_cpu(emulated.executable, [x, y]), [x.sum(0), y.sum(0), (x * x).sum(0)]):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    source = cuda_source(built.executable)
    assert "__syncthreads" in source
    if NVCC is not None:
        _no_spills(source, tmp_path)


def test_column_sums_keep_their_column_split_where_the_packed_walks_are_slower():
    """Three column sums of 1024, 2048 and 4096 rows: their thread-per-column walks could share
    one launch, but a walk runs a column's rows serially in one thread (latency-bound far beyond
    a launch overhead), so each keeps its column-split plan: two of one block shape share a
    launch, the third launches apart (2 launches in all, not the walks' 1)."""
    tensors = [tensor(f"t{i}", (rows, 256)) for i, rows in enumerate((1024, 2048, 4096))]
    mod = make_module(tensors, lambda bb, *ts: relax.Tuple([bb.emit(op.sum(t, axis=[0])) for t in ts]))
    built = build(mod, CUDA, stitched=True, strict=True)
    assert count_launches(built.lowered, built.executable) == 2 and len(built.report.packs) == 1
    assert all(p.scheme == "column-split" and 0 < p.modeled_us < 10 for p in built.report.plans)


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_packed_column_split_is_clean_under_simt(oclgrind):
    report = _simt(_independent_sums(64), oclgrind=oclgrind)
    assert report.stitch.packs and [k.launches for k in report.kernels] == [1], str(report)
