"""The stitched CUDA kernels run with SIMT semantics on the CPU (tvm_stitch.simt: OpenCL on pocl, Oclgrind)."""

import glob
import os
import warnings

import numpy as np
import pytest
import tvm

cl = pytest.importorskip("pyopencl")

from tvm import relax, tirx  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from tvm_stitch import simt  # noqa: E402
from tvm_stitch.simt import opencl_run  # noqa: E402
from tvm_stitch.simt.simt_kernel import Reference, check_kernel  # noqa: E402
from tvm_stitch.tools.cli import main  # noqa: E402
from tvm_stitch.tools.fuzz import (OCLGRIND_MAX_ELEMENTS, Spec, _concrete_spec, _elements, build_module,  # noqa: E402
                                   random_spec, simt_check)
from tvm_stitch.tools.workloads import SUITE, dims  # noqa: E402
from conftest import opencl_device

REGRESSIONS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "regressions", "*.json")))


@pytest.mark.parametrize("name,dtype", [(n, d) for n, g in SUITE.items() for d in g.dtypes])
def test_suite_kernels_match_on_pocl(name, dtype):
    opencl_device(False)
    report = simt.check(SUITE[name].build(dtype, dims("test")))
    assert report.kernels, report.stitch
    assert report.ok, str(report)
    for kernel in report.kernels:
        assert kernel.launches >= 1 and kernel.max_error < 0.05, kernel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_row_split_phases_and_partials_run_in_order(dtype):
    """Online softmax: the max and sum partials in one launch (float16: exp and sum in float32)."""
    opencl_device(False)
    report = simt.check(SUITE["softmax"].build(dtype, {"rows": 4, "cols": 20000}))
    assert [k.launches for k in report.kernels] == [2], str(report)
    assert report.ok, str(report)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[os.path.basename(p) for p in REGRESSIONS])
def test_saved_regressions_match_on_pocl(path):
    opencl_device(False)
    with open(path, encoding="utf-8") as f:
        outcome, _ = simt_check(Spec.from_json(f.read()))
    assert outcome.ok, outcome.message


def test_small_random_graphs_are_clean_under_oclgrind():
    opencl_device(True)
    checked = 0
    for seed in range(40):
        spec = random_spec(seed)
        sizes = spec.sizes.get("n")
        if _elements(_concrete_spec(spec, max(sizes)) if sizes else spec) > OCLGRIND_MAX_ELEMENTS:
            continue
        outcome, platform = simt_check(spec, oclgrind=True, seed=seed)
        assert outcome.ok, (seed, outcome.message)
        if outcome.simt_kernels:
            assert platform.startswith("Oclgrind")
            checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_packed_rows_share_no_reduction_result_unsynchronised():
    """Regression: with rows packed per block (threadIdx.y) and one warp per row, the sum's result
    went through shared memory, stored by lane 0 and read by the warp with no barrier between."""
    opencl_device(True)
    report = simt.check(SUITE["softmax_short_rows"].build("float32", dims("test")), oclgrind=True)
    assert report.stitch.plans[0].mapping.rows_per_task > 1
    assert report.ok, str(report)


def test_pad_of_one_column_matches_under_oclgrind():
    """Regression (fuzz seed 197): the pad's `2 <= c && c < 3`, `c = id & 3`, optimised by Oclgrind
    21.10's compiler, was taken by every work-item past the first row (a mismatch on a correct
    kernel: pocl and the unoptimised program agree with the reference)."""
    opencl_device(True)
    x = relax.Var("x", relax.TensorType((4, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.exp(relax.op.nn.pad(x, [0, 0, 2, 1]))))
        bb.emit_func_output(out)
    report = simt.check(bb.get(), oclgrind=True)
    assert report.platform.startswith("Oclgrind") and len(report.kernels) == 1
    assert report.ok, str(report)


@T.prim_func(s_tir=True)
def _all_threads_write_one_shared_word(x: T.Buffer((4, 64), "float32"), y: T.Buffer((4, 64), "float32")):
    s = T.sblock_alloc_buffer((1,), scope="shared")
    for b in T.thread_binding(4, thread="blockIdx.x"):
        for t in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("stage"):
                vb, vt = T.axis.remap("SS", [b, t])
                s[0] = x[vb, vt]
        for t in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("use"):
                vb, vt = T.axis.remap("SS", [b, t])
                y[vb, vt] = s[0] + x[vb, vt]


@T.prim_func(s_tir=True)
def _last_column_plus(x: T.Buffer((4, 64), "float32"), y: T.Buffer((4, 64), "float32")):
    for b, t in T.grid(4, 64):
        with T.sblock("use"):
            vb, vt = T.axis.remap("SS", [b, t])
            y[vb, vt] = x[vb, 63] + x[vb, vt]


@T.prim_func(s_tir=True)
def _writes_one_row_too_far(x: T.Buffer((4, 64), "float32"), y: T.Buffer((4, 64), "float32")):
    for b in T.thread_binding(4, thread="blockIdx.x"):
        for t in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("copy"):
                vb, vt = T.axis.remap("SS", [b, t])
                y[vb, vt] = x[vb, vt]
                y[vb + 1, vt] = x[vb, vt]


@T.prim_func(s_tir=True)
def _copy(x: T.Buffer((4, 64), "float32"), y: T.Buffer((4, 64), "float32")):
    for b, t in T.grid(4, 64):
        with T.sblock("copy"):
            vb, vt = T.axis.remap("SS", [b, t])
            y[vb, vt] = x[vb, vt]


def test_planted_race_is_reported_by_oclgrind():
    result = check_kernel("racy", _all_threads_write_one_shared_word, [Reference(_last_column_plus, (0, 1))],
                          opencl_device(True), True, 0)
    assert result.status == "race", result
    assert "data race at local memory" in result.detail


def test_planted_write_past_the_end_hits_the_guard_zone_on_pocl():
    result = check_kernel("oob", _writes_one_row_too_far, [Reference(_copy, (0, 1))], opencl_device(False), False, 0)
    assert result.status == "out-of-bounds", result
    assert "256 bytes past its end" in result.detail


def test_planted_write_past_the_end_is_reported_by_oclgrind():
    result = check_kernel("oob", _writes_one_row_too_far, [Reference(_copy, (0, 1))], opencl_device(True), True, 0)
    assert result.status == "out-of-bounds", result
    assert "Invalid write" in result.detail


@T.prim_func(s_tir=True)
def _bound_copy(x: T.Buffer((4, 64), "float32"), y: T.Buffer((4, 64), "float32")):
    for b in T.thread_binding(4, thread="blockIdx.x"):
        for t in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("copy"):
                vb, vt = T.axis.remap("SS", [b, t])
                y[vb, vt] = x[vb, vt]


def test_wrong_values_are_a_mismatch():
    result = check_kernel("copy", _bound_copy, [Reference(_last_column_plus, (0, 1))], opencl_device(False), False, 0)
    assert result.status == "mismatch" and result.max_error > 0.1, result


def test_bound_copy_matches_its_reference():
    result = check_kernel("copy", _bound_copy, [Reference(_copy, (0, 1))], opencl_device(False), False, 0)
    assert result.ok and result.max_error == 0.0, result


def test_cli_prints_one_line_per_kernel_and_fails_on_bad_input(capsys):
    opencl_device(False)
    assert main(["simt", "cross_entropy", "--size", "test"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nok ") == 2 and "2 stitched kernels checked" in out
    assert main(["simt", "no_such_graph"]) == 2


def test_check_rejects_a_non_cuda_target():
    with pytest.raises(ValueError, match="cuda"):
        simt.check(SUITE["softmax"].build("float32", dims("test")), {"kind": "llvm"})
    with pytest.raises(TypeError):
        simt.check(np.zeros(3))


@pytest.mark.parametrize("oclgrind,std", [(False, ""), (False, "-cl-std=CL2.0"), (True, ""), (True, "-cl-std=CL2.0")],
                         ids=["pocl", "pocl-cl2", "oclgrind", "oclgrind-cl2"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_narrow_float_rounding_matches_ieee_round_to_nearest_even(kind, oclgrind, std):
    """On both devices, in OpenCL C 1.2 and 2.0 (the build of a kernel with arrival counters)."""
    import ml_dtypes

    from tvm_stitch.simt.narrow_floats import HELPERS, ROUND

    device = opencl_device(oclgrind)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                             [65504, 65519, 65520, 7e4, 6e-8, 2.9e-8, 3e-8, 2 ** -14, 2 ** -14 - 2 ** -25,
                              3 * 2 ** -25, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                              3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(np.float32)
    source = HELPERS + f"__kernel void k(__global float* a) {{ int i = get_global_id(0); a[i] = {ROUND[kind]}(a[i]); }}"
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        program = cl.Program(ctx, source).build(options=[std] if std else [])
    program.k(queue, (values.size,), None, buf)
    got = np.empty_like(values)
    cl.enqueue_copy(queue, got, buf)
    narrow = np.float16 if kind == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        want = values.astype(narrow).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# --- kernels of symbolic shape ---------------------------------------------------------------

def _bounded(func, lower: dict, upper: dict):
    return tvm.IRModule({"main": func.with_attr("tir_var_lower_bound", lower).with_attr("tir_var_upper_bound", upper)})


@R.function
def _symbolic_layer_norm(x: R.Tensor(("n", 256), "float32"), g: R.Tensor((256,), "float32"),
                         b: R.Tensor((256,), "float32")):
    with R.dataflow():
        y = R.nn.layer_norm(x, g, b, axes=[-1])
        R.output(y)
    return y


@R.function
def _symbolic_softmax(x: R.Tensor(("b", "s", "s"), "float32")):
    with R.dataflow():
        y = R.nn.softmax(x, axis=-1)
        R.output(y)
    return y


@R.function
def _symbolic_rms_norm(x: R.Tensor(("n", 4096), "float32"), w: R.Tensor((4096,), "float32")):
    with R.dataflow():
        y = R.nn.rms_norm(x, w, axes=[-1])
        R.output(y)
    return y


@R.function
def _symbolic_small_kernels(x: R.Tensor(("n", 64), "float32"), y: R.Tensor(("n", 64), "float32"),
                            z: R.Tensor(("n", 32), "float32")):
    with R.dataflow():
        a = R.nn.gelu(x)
        b = R.sigmoid(y)
        c = R.exp(z)
        R.output(a, b, c)
    return (a, b, c)


@pytest.mark.parametrize("func,lower,upper,sizes", [
    (_symbolic_layer_norm, {"n": 1}, {"n": 40}, ("n=1", "n=37", "n=40")),
    (_symbolic_softmax, {"b": 1, "s": 2}, {"b": 3, "s": 40}, ("b=1, s=2", "b=3, s=37", "b=3, s=40")),
    (_symbolic_rms_norm, {"n": 2}, {"n": 9}, ("n=2", "n=9")),
], ids=["layer_norm", "softmax", "rms_norm"])
def test_symbolic_kernels_run_at_their_bounds_and_an_odd_size(func, lower, upper, sizes):
    """One build of the symbolic kernel, launched at the lower bound, an odd size and the upper bound."""
    opencl_device(False)
    report = simt.check(_bounded(func, lower, upper))
    assert [k.sizes for k in report.kernels] == [sizes], str(report)
    assert report.ok, str(report)
    assert all(k.launches == 1 for k in report.kernels)


def test_symbolic_packed_kernels_run_at_the_given_sizes():
    opencl_device(False)
    report = simt.check(tvm.IRModule({"main": _symbolic_small_kernels}), sizes={"n": [1, 5, 33]})
    assert [members for _, members in report.stitch.packs] and len(report.kernels) == 1, str(report)
    assert report.kernels[0].sizes == ("n=1", "n=5", "n=33") and report.ok, str(report)


def test_symbolic_softmax_is_clean_under_oclgrind():
    opencl_device(True)
    report = simt.check(_bounded(_symbolic_softmax, {"b": 1, "s": 2}, {"b": 2, "s": 9}), oclgrind=True)
    assert report.kernels[0].sizes == ("b=1, s=2", "b=2, s=9"), str(report)
    assert report.ok, str(report)


_n = tirx.Var("n", "int64")


@T.prim_func(s_tir=True)
def _two_rows_per_block_floor_grid(x: T.Buffer((_n, 64), "float32"), y: T.Buffer((_n, 64), "float32")):
    for blk in T.thread_binding(_n // 2, thread="blockIdx.x"):
        for r in T.thread_binding(2, thread="threadIdx.y"):
            for t in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("copy"):
                    vr = T.axis.spatial(_n, blk * 2 + r)
                    vt = T.axis.spatial(64, t)
                    y[vr, vt] = x[vr, vt]


@T.prim_func(s_tir=True)
def _two_rows_per_block(x: T.Buffer((_n, 64), "float32"), y: T.Buffer((_n, 64), "float32")):
    for blk in T.thread_binding((_n + 1) // 2, thread="blockIdx.x"):
        for r in T.thread_binding(2, thread="threadIdx.y"):
            for t in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("copy"):
                    T.where(blk * 2 + r < _n)
                    vr = T.axis.spatial(_n, blk * 2 + r)
                    vt = T.axis.spatial(64, t)
                    y[vr, vt] = x[vr, vt]


@T.prim_func(s_tir=True)
def _symbolic_copy(x: T.Buffer((_n, 64), "float32"), y: T.Buffer((_n, 64), "float32")):
    for i, j in T.grid(_n, 64):
        with T.sblock("copy"):
            vi, vj = T.axis.remap("SS", [i, j])
            y[vi, vj] = x[vi, vj]


def test_planted_symbolic_grid_bug_is_caught_at_an_odd_size():
    """Two rows per block and a grid of n // 2 blocks: right for even n, the last row unwritten for odd n."""
    device = opencl_device(False)
    points = [{"n": 2}, {"n": 37}, {"n": 128}]
    bad = check_kernel("floor", _two_rows_per_block_floor_grid, [Reference(_symbolic_copy, (0, 1))], device, False,
                       0, points)
    assert bad.status == "mismatch", bad
    assert bad.detail.startswith("at n=37: 64 of 2368 output elements") and "ok at n=2; n=128" in bad.detail, bad
    good = check_kernel("ceil", _two_rows_per_block, [Reference(_symbolic_copy, (0, 1))], device, False, 0, points)
    assert good.ok and good.sizes == ("n=2", "n=37", "n=128"), good


def test_fuzzer_runs_its_symbolic_specs_symbolic_under_simt():
    """The fuzzer's symbolic graphs are built symbolic; their symbolic kernels run at the spec's sizes."""
    opencl_device(False)
    symbolic = 0
    for seed in [s for s in range(100) if random_spec(s).sizes][:3]:
        spec = random_spec(seed)
        outcome, _ = simt_check(spec, seed=seed)
        assert outcome.ok and outcome.simt_kernels >= 1, (seed, outcome.message)
        report = simt.check(build_module(spec), sizes=spec.sizes)
        checked = [k.sizes for k in report.kernels if k.sizes]
        assert all(sizes == tuple(f"n={v}" for v in spec.sizes["n"]) for sizes in checked), (seed, str(report))
        symbolic += len(checked)
    assert symbolic >= 2


def test_cli_runs_a_symbolic_script_at_the_given_sizes_and_refuses_bad_ones(tmp_path, capsys):
    opencl_device(False)
    script = tmp_path / "symbolic_softmax.py"
    script.write_text("import tvm\nfrom tvm.script import relax as R\n\n"
                      "@R.function\n"
                      "def main(x: R.Tensor(('n', 64), 'float32')):\n"
                      "    with R.dataflow():\n"
                      "        y = R.nn.softmax(x, axis=-1)\n"
                      "        R.output(y)\n"
                      "    return y\n\n"
                      "mod = tvm.IRModule({'main': main})\n")
    assert main(["simt", str(script), "--sizes", "n=3,5"]) == 0
    out = capsys.readouterr().out
    # the (n, 64) softmax is compiled as size variants (kernels/variants.py): each size runs the one it chooses
    assert "each run where it is chosen (n=3; n=5)" in out and "output elements match" in out, out
    assert "1 of symbolic shape" in out and "0 not ok" in out, out
    assert main(["simt", str(script), "--sizes", "n=three"]) == 2
    assert "--sizes 'n=three'" in capsys.readouterr().err


def test_kernel_over_oclgrinds_local_memory_is_checked_as_planned_within_it():
    """A 20000-long float16 row kept in shared memory (40 KB: CUDA's 48 KB hold it, Oclgrind's 32 KB
    do not): the launch fails with OUT_OF_RESOURCES, and the kernel is checked planned within 32 KB."""
    opencl_device(True)
    spec = Spec.from_json(
        '{"inputs": [[[20000], "float16"]], "steps": [{"op": "log", "args": [0], "params": {}}, '
        '{"op": "flip", "args": [1], "params": {"axis": 0}}, {"op": "sigmoid", "args": [0], "params": {}}, '
        '{"op": "min", "args": [1], "params": {"axes": [0], "keepdims": true}}, '
        '{"op": "slice", "args": [2], "params": {"axis": 0, "begin": 3054, "end": 12735}}, '
        '{"op": "mean", "args": [3], "params": {"axes": [0], "keepdims": false}}, '
        '{"op": "sigmoid", "args": [5], "params": {}}], "outputs": [7, 4], "sizes": {}}')
    report = simt.check(build_module(spec), oclgrind=True, seed=111)
    assert report.stitch.plans[0].shared_bytes > opencl_run.device_for(True).local_mem_size
    assert report.platform.startswith("Oclgrind")
    assert report.ok, str(report)
    assert "over Oclgrind's local memory" in report.kernels[0].detail


def test_math_without_an_opencl_rule_runs_under_oclgrind():
    """TVM names atanh, asinh and acosh by C's libm in OpenCL source (`atanhf`), which OpenCL C does
    not declare: the checker's source calls OpenCL's built-ins of the same names."""
    opencl_device(True)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            squashed = bb.emit(relax.op.add(relax.op.multiply(relax.op.tanh(x), relax.const(0.45)),
                                            relax.const(0.5)))
            total = relax.op.add(relax.op.atanh(squashed), relax.op.asinh(squashed))
            out = bb.emit_output(relax.op.sum(relax.op.add(total, relax.op.acosh(relax.op.add(
                squashed, relax.const(1.0)))), axis=[-1]))
        bb.emit_func_output(out)
    report = simt.check(bb.get(), oclgrind=True)
    assert report.kernels and report.ok, str(report)



def test_vectorised_tan_builds_for_opencl():
    """TVM's OpenCL lowering leaves a vectorised tan unresolved; the checker builds it as sin / cos."""
    from tvm_stitch.simt.opencl_build import build_opencl

    x = tvm.te.placeholder((64,), "float32", name="x")
    y = tvm.te.compute((64,), lambda i: tvm.tirx.tan(x[i]), name="y")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([x, y]))
    outer, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 4])
    sch.bind(outer, "threadIdx.x")
    sch.vectorize(inner)
    source = build_opencl(sch.mod["main"]).source
    assert "sin(" in source and "cos(" in source
