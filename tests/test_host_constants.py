"""Constant subgraphs (a packed-sequence check, a causal mask) evaluated on the host for GPU targets."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_stitch.rewrites.host_constants import FoldHostConstants, constant_bindings
from tvm_stitch.report import StitchReport
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import launches_by_kind
from tvm_stitch.target import default_pipeline


def _masked_scores(n: int = 16):
    """x + where(cumsum(positions differ by other than 1) equal, 0, -inf): the mask needs no input."""

    @tvm.script.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4, n, n), "float32")) -> R.Tensor((4, n, n), "float32"):
            with R.dataflow():
                pos = R.arange(0, n, 1, dtype="int64")
                step = R.subtract(R.strided_slice(pos, (0,), (1,), (n,)), R.strided_slice(pos, (0,), (0,), (n - 1,)))
                packed = R.cumsum(R.not_equal(step, R.const(1, "int64")), axis=-1, dtype="int64")
                causal = R.less_equal(R.expand_dims(pos, [0]), R.expand_dims(pos, [1]))
                keep = R.logical_and(causal, R.equal(R.sum(packed), R.const(0, "int64")))
                mask = R.where(keep, R.const(0.0, "float32"), R.const(-1e9, "float32"))
                out = R.nn.softmax(R.add(x, mask), axis=-1)
                R.output(out)
            return out

    return Module


def _reference(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    keep = np.arange(n)[None, :] <= np.arange(n)[:, None]
    z = x + np.where(keep, 0.0, -1e9).astype("float32")
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_a_mask_of_constants_is_evaluated_once_and_matches_numpy():
    mod = _masked_scores()
    report = StitchReport()
    folded = FoldHostConstants(report=report)(mod)
    text = folded["main"].script()
    assert "cumsum" not in text and "arange" not in text and "softmax" in text
    assert report.notes and "evaluated on the host" in report.notes[0]
    x = np.random.default_rng(0).standard_normal((4, 16, 16)).astype("float32")
    target = tvm.target.Target("llvm")
    executable = tvm.compile(folded, target=target, relax_pipeline=default_pipeline(target))
    (out,) = run_cpu(executable, [x])
    np.testing.assert_allclose(out, _reference(x), rtol=1e-5, atol=1e-6)


def test_the_cuda_build_launches_only_the_kernel_that_reads_the_input():
    mod = _masked_scores()
    gpu = {"kind": "cuda", "arch": "sm_90"}
    default_build = build(mod, gpu, stitched=False)
    default = launches_by_kind(default_build.lowered, default_build.executable)
    stitched_build = build(mod, gpu, stitched=True)
    stitched = launches_by_kind(stitched_build.lowered, stitched_build.executable)
    assert default[0] > 4  # the scan alone takes several launches on TVM's path
    assert stitched[0] == 1


def test_nothing_of_a_symbolic_size_or_reading_a_parameter_folds():
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pos = bb.emit(relax.op.arange(0, n, 1, dtype="float32"))
            out = bb.emit_output(relax.op.add(x, pos))
        bb.emit_func_output(out)
    mod = bb.get()
    assert constant_bindings(mod["main"]) == ([], [])
    assert FoldHostConstants()(mod).same_as(mod)


def test_a_constant_larger_than_the_limit_stays_a_computation():
    mod = _masked_scores(64)
    bindings, _ = constant_bindings(mod["main"], max_bytes=1024)  # the 64x64 masks are 4-16 KB
    names = [b.value.op.name for b in bindings]
    assert "relax.arange" in names and "relax.where" not in names
