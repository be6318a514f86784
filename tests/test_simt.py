"""The stitched CUDA kernels run with SIMT semantics on the CPU (tvm_stitch.simt: OpenCL on pocl, Oclgrind)."""

import glob
import os
import warnings

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from tvm.script import tirx as T  # noqa: E402

from tvm_stitch import simt  # noqa: E402
from tvm_stitch.check import opencl_run  # noqa: E402
from tvm_stitch.check.simt_kernel import Reference, check_kernel  # noqa: E402
from tvm_stitch.tools.cli import main  # noqa: E402
from tvm_stitch.tools.fuzz import OCLGRIND_MAX_ELEMENTS, Spec, _concrete_spec, _elements, random_spec, simt_check  # noqa: E402
from tvm_stitch.tools.suite import SUITE, dims  # noqa: E402

REGRESSIONS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "regressions", "*.json")))


def _device(oclgrind: bool):
    try:
        return opencl_run.device_for(oclgrind)
    except opencl_run.NoOpenclDevice as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("name,dtype", [(n, d) for n, g in SUITE.items() for d in g.dtypes])
def test_suite_kernels_match_on_pocl(name, dtype):
    _device(False)
    report = simt.check(SUITE[name].build(dtype, dims("test")))
    assert report.kernels, report.stitch
    assert report.ok, str(report)
    for kernel in report.kernels:
        assert kernel.launches >= 1 and kernel.max_error < 0.05, kernel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_row_split_phases_and_partials_run_in_order(dtype):
    """Online softmax: the max and sum partials in one launch (float16: exp and sum in float32)."""
    _device(False)
    report = simt.check(SUITE["softmax"].build(dtype, {"rows": 4, "cols": 20000}))
    assert [k.launches for k in report.kernels] == [2], str(report)
    assert report.ok, str(report)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[os.path.basename(p) for p in REGRESSIONS])
def test_saved_regressions_match_on_pocl(path):
    _device(False)
    with open(path, encoding="utf-8") as f:
        outcome, _ = simt_check(Spec.from_json(f.read()))
    assert outcome.ok, outcome.message


def test_small_random_graphs_are_clean_under_oclgrind():
    _device(True)
    checked = 0
    for seed in range(40):
        spec = random_spec(seed)
        sizes = spec.sizes.get("n")
        if _elements(_concrete_spec(spec, sizes[0]) if sizes else spec) > OCLGRIND_MAX_ELEMENTS:
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
    _device(True)
    report = simt.check(SUITE["softmax_short_rows"].build("float32", dims("test")), oclgrind=True)
    assert report.stitch.plans[0].mapping.rows_per_task > 1
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
                          _device(True), True, 0)
    assert result.status == "race", result
    assert "data race at local memory" in result.detail


def test_planted_write_past_the_end_hits_the_guard_zone_on_pocl():
    result = check_kernel("oob", _writes_one_row_too_far, [Reference(_copy, (0, 1))], _device(False), False, 0)
    assert result.status == "out-of-bounds", result
    assert "256 bytes past its end" in result.detail


def test_planted_write_past_the_end_is_reported_by_oclgrind():
    result = check_kernel("oob", _writes_one_row_too_far, [Reference(_copy, (0, 1))], _device(True), True, 0)
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
    result = check_kernel("copy", _bound_copy, [Reference(_last_column_plus, (0, 1))], _device(False), False, 0)
    assert result.status == "mismatch" and result.max_error > 0.1, result


def test_bound_copy_matches_its_reference():
    result = check_kernel("copy", _bound_copy, [Reference(_copy, (0, 1))], _device(False), False, 0)
    assert result.ok and result.max_error == 0.0, result


def test_cli_prints_one_line_per_kernel_and_fails_on_bad_input(capsys):
    _device(False)
    assert main(["simt", "cross_entropy", "--size", "test"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nok ") == 2 and "2 stitched kernels checked" in out
    assert main(["simt", "no_such_graph"]) == 2


def test_check_rejects_a_non_cuda_target():
    with pytest.raises(ValueError, match="cuda"):
        simt.check(SUITE["softmax"].build("float32", dims("test")), {"kind": "llvm"})
    with pytest.raises(TypeError):
        simt.check(np.zeros(3))


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_narrow_float_rounding_matches_ieee_round_to_nearest_even(kind):
    import ml_dtypes

    from tvm_stitch.check.narrow_floats import HELPERS, ROUND

    device = _device(False)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                             [65504, 65519, 65520, 7e4, 6e-8, 2.9e-8, 3e-8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                              3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(np.float32)
    source = HELPERS + f"__kernel void k(__global float* a) {{ int i = get_global_id(0); a[i] = {ROUND[kind]}(a[i]); }}"
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        program = cl.Program(ctx, source).build()
    program.k(queue, (values.size,), None, buf)
    got = np.empty_like(values)
    cl.enqueue_copy(queue, got, buf)
    narrow = np.float16 if kind == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        want = values.astype(narrow).astype(np.float32)
    np.testing.assert_array_equal(got, want)
