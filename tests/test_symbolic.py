"""Symbolic dimensions are stitched: one kernel per group, grid from the runtime extent, right at every size."""

import numpy as np
import pytest
from tvm import relax, tirx

from tvm_stitch.kernels import outline
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches

from conftest import make_module, tensor


def _layer_norm_softmax(bb, x):
    mean = bb.emit(relax.op.mean(x, axis=-1, keepdims=True))
    centred = bb.emit(relax.op.subtract(x, mean))
    var = bb.emit(relax.op.mean(relax.op.multiply(centred, centred), axis=-1, keepdims=True))
    normed = bb.emit(relax.op.divide(centred, relax.op.sqrt(relax.op.add(var, relax.const(1e-5)))))
    return relax.op.nn.softmax(normed, axis=-1)


def _np_layer_norm_softmax(x):
    centred = x - x.mean(-1, keepdims=True)
    normed = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)
    e = np.exp(normed - normed.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _scaled_softmax(bb, x):
    return relax.op.nn.softmax(bb.emit(relax.op.multiply(x, relax.const(0.125))), axis=-1)


def _np_scaled_softmax(x):
    e = np.exp(x * 0.125 - (x * 0.125).max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


N, B, S = (tirx.Var(name, "int64") for name in ("n", "b", "s"))
CASES = {
    # static row length, symbolic rows
    "rows": ([N, 256], _layer_norm_softmax, _np_layer_norm_softmax, [(1, 256), (333, 256), (2048, 256)]),
    "batch_x_sequence": ([B, S, 256], _layer_norm_softmax, _np_layer_norm_softmax,
                         [(1, 1, 256), (3, 111, 256), (2, 300, 256)]),
    # symbolic row length: attention scores over a symbolic key length
    "row_length": ([4, S, S], _scaled_softmax, _np_scaled_softmax, [(4, 1, 1), (4, 37, 37), (4, 300, 300)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_symbolic_group_is_one_kernel_and_matches_numpy(case, rng):
    shape, body, reference, sizes = CASES[case]
    mod = make_module([tensor("x", shape)], body)
    for emulate in (None, "cuda"):
        built = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        assert len(built.report.plans) == 1 and not built.report.fallbacks, built.report.details()
        for size in sizes:
            x = rng.standard_normal(size).astype("float32")
            np.testing.assert_allclose(run_cpu(built.executable, [x])[0], reference(x), rtol=1e-4, atol=1e-6)
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert not cuda.report.fallbacks, cuda.report.details()
    assert count_launches(cuda.lowered, cuda.executable) == 1
    assert any("symbolic" in note for plan in cuda.report.plans for note in plan.notes)


def test_symbolic_row_length_streams_instead_of_shared_memory():
    mod = make_module([tensor("x", [4, S, S])], _scaled_softmax)
    plan = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True).report.plans[0]
    # Per-row scalars (max, sum) and TVM's all-reduce staging only: no row of symbolic length on chip.
    assert all(nbytes <= 8 for nbytes in plan.shared_rows) and plan.shared_bytes <= 1024
    assert any("symbolic row length" in note for note in plan.notes)


def test_ill_formed_outlined_group_falls_back(monkeypatch, rng):
    # The safety net: without binding the callees' symbolic variables, the group is ill-formed;
    # it must fall back (never reach FuseTIR), and the build stays right.
    monkeypatch.setattr(outline, "_bound_to_caller", lambda func, args: func)
    mod = make_module([tensor("x", [N, 256])], _layer_norm_softmax)
    built = build(mod, {"kind": "llvm"}, stitched=True)
    assert built.report.fallbacks and built.report.fallbacks[0].reason.code == "error"
    assert "not well-formed" in built.report.fallbacks[0].reason.params["message"]
    x = rng.standard_normal((5, 256)).astype("float32")
    np.testing.assert_allclose(run_cpu(built.executable, [x])[0], _np_layer_norm_softmax(x), rtol=1e-4, atol=1e-6)


def test_reshape_over_a_symbolic_sequence_reads_rows_aligned():
    # (2, s, 64) -> (2, s, 4, 16): the legalized index is (b*s + t) // s, (b*s + t) % s, which the
    # simplifier keeps for a symbolic s; row alignment must still see row (b, t) read from (b, t).
    from tvm_stitch.analysis.row_alignment import ALIGNED, analyze_rows

    from conftest import legalized

    mod = legalized(make_module([tensor("x", [2, S, 64])], lambda bb, x: relax.op.reshape(x, [2, S, 4, 16])))
    reshape = next(f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))
    rows = analyze_rows(reshape)
    assert rows.param_access[0][2] == ALIGNED


def _layer_norm_then_reshape(bb, x, gamma, beta):
    # GPT-2's final LayerNorm: the reshape back to (2, s, 64) indexes its input as
    # ((b * s + t) // s % 2, (b * s + t) % s, c), which TVM keeps for a symbolic s.
    normed = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1]))
    return relax.op.reshape(normed, relax.ShapeExpr([2, S, 64]))


def test_layer_norm_before_a_symbolic_reshape_stitches_with_rows_on_chip(rng):
    mod = make_module([tensor("x", [2, S, 64]), tensor("g", [64]), tensor("b", [64])], _layer_norm_then_reshape)
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert not cuda.report.fallbacks, cuda.report.details()
    assert count_launches(cuda.lowered, cuda.executable) == 1
    assert cuda.report.plans[0].cached_inputs == ("x",)  # the row stays on chip, at a static size
    g, b = rng.standard_normal(64).astype("float32"), rng.standard_normal(64).astype("float32")
    for emulate in (None, "cuda"):
        cpu = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        assert not cpu.report.fallbacks, cpu.report.details()
        for length in (1, 7, 130):
            x = rng.standard_normal((2, length, 64)).astype("float32")
            centred = x - x.mean(-1, keepdims=True)
            expected = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * g + b
            np.testing.assert_allclose(run_cpu(cpu.executable, [x, g, b])[0], expected, rtol=1e-4, atol=1e-5)
