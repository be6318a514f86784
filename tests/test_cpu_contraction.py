"""CPU schedules of compute-intensive ops (schedules/cpu/contraction.py) in the llvm stitch pipeline:
matmuls and convolutions with their fused epilogues are scheduled (parallel, vectorised) and match numpy."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_stitch.pipeline import pipeline  # before schedules: tvm_stitch's import order breaks the cycle
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import run_cpu

from schedules.cpu import contraction

from conftest import make_module, tensor

HOST = host_target()
HOST_SPEC = TargetSpec.from_target(HOST)


def _build(mod):
    with HOST:
        lowered = pipeline(HOST)(mod)
    return lowered, tvm.compile(lowered, target=HOST, relax_pipeline=None)


def _contraction_funcs(lowered) -> list:
    """The PrimFuncs that hold a matmul or convolution reduction."""
    out = []
    for gv, func in lowered.functions_items():
        if isinstance(func, tirx.PrimFunc) and ("matmul" in gv.name_hint or "conv" in gv.name_hint):
            out.append(func)
    return out


def _assert_scheduled(lowered):
    funcs = _contraction_funcs(lowered)
    assert funcs
    for func in funcs:
        assert func.attrs.get("tirx.is_scheduled", False)
        text = func.script()
        assert "T.parallel(" in text and "T.vectorized(" in text


def test_dense_matmul_with_bias_and_gelu(rng):
    m, k, n = 48, 40, 96
    x, w, b = tensor("x", (m, k)), tensor("w", (k, n)), tensor("b", (n,))
    mod = make_module([x, w, b], lambda bb, x, w, b: bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b))))
    lowered, ex = _build(mod)
    _assert_scheduled(lowered)
    a, wt, bias = (rng.standard_normal(s).astype("float32") for s in ((m, k), (k, n), (n,)))
    (out,) = run_cpu(ex, [a, wt, bias])
    from math import erf

    y = a.astype(np.float64) @ wt + bias
    want = y * 0.5 * (1.0 + np.vectorize(erf)(y / np.sqrt(2.0)))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_batched_matmul_with_residual(rng):
    shape_a, shape_b, shape_r = (6, 32, 16), (6, 16, 24), (6, 32, 24)
    x, y, r = tensor("x", shape_a), tensor("y", shape_b), tensor("r", shape_r)
    mod = make_module([x, y, r], lambda bb, x, y, r: bb.emit(relax.op.add(relax.op.matmul(x, y), r)))
    lowered, ex = _build(mod)
    _assert_scheduled(lowered)
    a, b, res = (rng.standard_normal(s).astype("float32") for s in (shape_a, shape_b, shape_r))
    (out,) = run_cpu(ex, [a, b, res])
    np.testing.assert_allclose(out, a @ b + res, rtol=1e-4, atol=1e-4)


def test_odd_shapes_still_match(rng):
    """Extents that no vector width divides: tiles shrink to divisors, results stay exact."""
    m, k, n = 7, 300, 13
    x, w = tensor("x", (m, k)), tensor("w", (k, n))
    mod = make_module([x, w], lambda bb, x, w: bb.emit(relax.op.matmul(x, w)))
    lowered, ex = _build(mod)
    a, wt = rng.standard_normal((m, k)).astype("float32"), rng.standard_normal((k, n)).astype("float32")
    (out,) = run_cpu(ex, [a, wt])
    np.testing.assert_allclose(out, a @ wt, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("groups", [1, 8])
def test_convolution_with_bias(rng, groups):
    """ConvNeXt's depthwise 7x7 (groups = channels) and a dense convolution, padded."""
    n, c, hw = 2, 8, 14
    x, w, b = tensor("x", (n, c, hw, hw)), tensor("w", (c, c // groups, 7, 7)), tensor("b", (1, c, 1, 1))
    mod = make_module([x, w, b], lambda bb, x, w, b: bb.emit(
        relax.op.add(relax.op.nn.conv2d(x, w, padding=3, groups=groups), b)))
    lowered, ex = _build(mod)
    _assert_scheduled(lowered)
    a = rng.standard_normal((n, c, hw, hw)).astype("float32")
    wt = rng.standard_normal((c, c // groups, 7, 7)).astype("float32")
    bias = rng.standard_normal((1, c, 1, 1)).astype("float32")
    (out,) = run_cpu(ex, [a, wt, bias])
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(wt), padding=3, groups=groups).numpy()
    np.testing.assert_allclose(out, want + bias, rtol=1e-4, atol=1e-4)


def test_strided_convolution_keeps_tvms_loop_nest(rng):
    """Along a stride-2 convolution's output columns its input is gathered: the rule declines (a
    3 x 3 window, padded: overlapping, not a patchify, which the pipeline makes a matmul)."""
    torch = pytest.importorskip("torch")
    x, w = tensor("x", (1, 4, 16, 16)), tensor("w", (8, 4, 3, 3))
    mod = make_module([x, w], lambda bb, x, w: bb.emit(relax.op.nn.conv2d(x, w, strides=2, padding=1)))
    with HOST:
        funcs = [f for gv, f in relax.transform.LegalizeOps()(mod).functions_items() if "conv" in gv.name_hint]
    assert funcs and contraction.apply(funcs[0], HOST, HOST_SPEC) is None
    _, ex = _build(mod)
    a, wt = rng.standard_normal((1, 4, 16, 16)).astype("float32"), rng.standard_normal((8, 4, 3, 3)).astype("float32")
    (out,) = run_cpu(ex, [a, wt])
    want = torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(wt), stride=2, padding=1).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_rule_declines_what_is_not_a_contraction():
    x = tensor("x", (16, 32))
    mod = make_module([x], lambda bb, x: bb.emit(relax.op.sum(relax.op.exp(x), axis=1)))
    with HOST:
        funcs = [f for _, f in relax.transform.LegalizeOps()(mod).functions_items() if isinstance(f, tirx.PrimFunc)]
    assert funcs and all(contraction.apply(f, HOST, HOST_SPEC) is None for f in funcs)
    assert contraction.apply(funcs[0], tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), HOST_SPEC) is None


def test_symbolic_rows_and_columns_are_tiled_with_short_last_tiles(rng):
    """Rows of a symbolic count (batch x sequence) against static weights, batched matmuls with a
    symbolic reduction (attention's probabilities times values) and symbolic columns (its scores):
    scheduled, exact at every count, including counts no tile divides."""
    n = tirx.Var("n", "int64")
    x, w, b = tensor("x", (n, 40)), tensor("w", (40, 96)), tensor("b", (96,))
    p, v, q = tensor("p", (3, n, n)), tensor("v", (3, n, 32)), tensor("q", (3, 32, n))

    def body(bb, x, w, b, p, v, q):
        return relax.Tuple([bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b))),
                            bb.emit(relax.op.matmul(p, v)), bb.emit(relax.op.matmul(v, q))])

    mod = make_module([x, w, b, p, v, q], body)
    lowered, ex = _build(mod)
    _assert_scheduled(lowered)
    from math import erf

    wt, bias = rng.standard_normal((40, 96)).astype("float32"), rng.standard_normal(96).astype("float32")
    for rows in (1, 7, 37, 130):
        a = rng.standard_normal((rows, 40)).astype("float32")
        probs, values, keys = (rng.standard_normal(s).astype("float32")
                               for s in ((3, rows, rows), (3, rows, 32), (3, 32, rows)))
        dense, batched, scores = run_cpu(ex, [a, wt, bias, probs, values, keys])
        y = a.astype(np.float64) @ wt + bias
        np.testing.assert_allclose(dense, y * 0.5 * (1.0 + np.vectorize(erf)(y / np.sqrt(2.0))), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(batched, probs @ values, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(scores, values @ keys, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes, registers", [(16, 32), (8, 16), (4, 16)])
@pytest.mark.parametrize("columns", [16, 32, 48, 64, 80, 96, 384, 1024, 13, None])
@pytest.mark.parametrize("rows", [6272, 512, 7, None])
def test_tile_fits_the_registers(lanes, registers, columns, rows):
    """Accumulators, one register per vector of the second operand and one broadcast fit in the
    registers; columns are whole vectors dividing the axis where one divides it; rows divide a
    static count."""
    tile_rows, cols = contraction._tile(columns, rows, lanes, registers)
    vectors = -(-cols // lanes)
    assert tile_rows * vectors + vectors + 1 <= registers
    if columns is not None:
        assert columns % cols == 0
        if columns % lanes == 0:
            assert cols % lanes == 0
    if rows is not None:
        assert rows % tile_rows == 0


def test_narrow_outputs_get_one_tile_wide_wider_ones_two_vectors():
    """On AVX-512, 96 output columns (ConvNeXt's MLP back to 96 channels) are one 4 x 96 tile,
    24 accumulators, the input read once; 384 columns keep 8 x 32 tiles."""
    assert contraction._tile(96, 6272, 16, 32) == (4, 96)
    assert contraction._tile(384, 6272, 16, 32) == (8, 32)


def test_wide_tile_with_bias_gelu_and_layer_scale_matches(rng):
    """The MLP's two matmuls with bias, GELU and layer scale on register tiles several vectors
    wide (row counts the tile rows divide and do not)."""
    from math import erf

    m, c, h = 40, 96, 384
    x, w1, b1 = tensor("x", (m, c)), tensor("w1", (c, h)), tensor("b1", (h,))
    w2, b2, g = tensor("w2", (h, c)), tensor("b2", (c,)), tensor("g", (c,))

    def body(bb, x, w1, b1, w2, b2, g):
        hidden = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w1), b1)))
        return bb.emit(relax.op.add(relax.op.multiply(relax.op.add(relax.op.matmul(hidden, w2), b2), g), x))

    lowered, ex = _build(make_module([x, w1, b1, w2, b2, g], body))
    _assert_scheduled(lowered)
    shapes = ((m, c), (c, h), (h,), (h, c), (c,), (c,))
    args = [(rng.standard_normal(s) * 0.2).astype("float32") for s in shapes]
    (out,) = run_cpu(ex, args)
    a, wa, ba, wb, bb_, gamma = (v.astype(np.float64) for v in args)
    y = a @ wa + ba
    hidden = y * 0.5 * (1.0 + np.vectorize(erf)(y / np.sqrt(2.0)))
    np.testing.assert_allclose(out, (hidden @ wb + bb_) * gamma + a, rtol=1e-4, atol=1e-4)
