"""The CPU pipeline's pieces for vision MLP blocks and patch stems (ConvNeXt, ViT): patchifying
convolutions as matmuls (rewrites/patchify.py), reshapes read by light element-wise ops joining the
matmul's kernel (rewrites/cpu_epilogue.py), and the contraction tiles they get
(schedules/cpu/contraction.py): rows-outer walks, narrower lanes, convolution tiles."""

from math import erf

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_stitch.pipeline import pipeline  # before schedules: tvm_stitch's import order breaks the cycle
from tvm_stitch.rewrites.patchify import PatchifyAsMatmul
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import run_cpu

from schedules.cpu import contraction

from conftest import make_module, tensor

HOST = host_target()


def _build(mod):
    with HOST:
        lowered = pipeline(HOST)(mod)
    return lowered, tvm.compile(lowered, target=HOST, relax_pipeline=None)


def _primfuncs(lowered) -> dict:
    return {gv.name_hint: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)}


def _ops(mod) -> list:
    found = []
    tvm.relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


@pytest.mark.parametrize("shape, kernel, channels", [((2, 3, 32, 32), 4, 16), ((1, 3, 32, 48), 16, 24),
                                                      ((1, 5, 12, 12), 2, 8)])
def test_patchifying_convolution_is_a_matmul_and_matches_torch(rng, shape, kernel, channels):
    """ConvNeXt's 4 x 4 stem, ViT's 16 x 16 patches on a non-square image, a 2 x 2 merge: no
    conv2d left, one matmul, the convolution's values (with its bias)."""
    torch = pytest.importorskip("torch")
    c = shape[1]
    x, w, b = tensor("x", shape), tensor("w", (channels, c, kernel, kernel)), tensor("b", (1, channels, 1, 1))
    mod = make_module([x, w, b], lambda bb, x, w, b: bb.emit(
        relax.op.add(relax.op.nn.conv2d(x, w, strides=kernel), b)))
    rewritten = PatchifyAsMatmul()(mod)
    assert "relax.nn.conv2d" not in _ops(rewritten) and _ops(rewritten).count("relax.matmul") == 1
    _, ex = _build(mod)
    a = rng.standard_normal(shape).astype("float32")
    wt = rng.standard_normal((channels, c, kernel, kernel)).astype("float32")
    bias = rng.standard_normal((1, channels, 1, 1)).astype("float32")
    (out,) = run_cpu(ex, [a, wt, bias])
    want = torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(wt), stride=kernel).numpy() + bias
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strides, padding, groups", [(2, 1, 1), (1, 0, 1), (4, 0, 2)])
def test_other_convolutions_stay_convolutions(strides, padding, groups):
    """Overlapping windows (stride below the kernel), padding, groups: not a patchify."""
    x, w = tensor("x", (1, 4, 16, 16)), tensor("w", (8, 4 // groups, 4, 4))
    mod = make_module([x, w], lambda bb, x, w: bb.emit(
        relax.op.nn.conv2d(x, w, strides=strides, padding=padding, groups=groups)))
    assert _ops(PatchifyAsMatmul()(mod)).count("relax.nn.conv2d") == 1


def _gelu(y):
    return y * 0.5 * (1.0 + np.vectorize(erf)(y / np.sqrt(2.0)))


def test_linear_on_4d_activations_keeps_bias_gelu_and_scale_in_the_matmul(rng):
    """ConvNeXt's MLP on channels-last 4-D activations (matmul, bias, reshape to 4-D, GELU; matmul,
    bias, reshape, layer scale): the GELU and the scale run in the matmuls' kernels, none of their
    own; a residual add after a reshape stays out of the matmul (it reads a full-size tensor)."""
    n, hw, c = 2, 4, 32
    rows = n * hw * hw
    x, w1, b1 = tensor("x", (rows, c)), tensor("w1", (c, 4 * c)), tensor("b1", (4 * c,))
    w2, b2, g, r = tensor("w2", (4 * c, c)), tensor("b2", (c,)), tensor("g", (c,)), tensor("r", (n, hw, hw, c))
    wr = tensor("wr", (c, c))
    op = relax.op

    def body(bb, x, w1, b1, w2, b2, g, r, wr):
        h = bb.emit(op.reshape(op.add(op.matmul(x, w1), b1), (n, hw, hw, 4 * c)))
        h = bb.emit(op.reshape(op.nn.gelu(h), (rows, 4 * c)))
        y = bb.emit(op.multiply(op.reshape(op.add(op.matmul(h, w2), b2), (n, hw, hw, c)), g))
        return bb.emit(op.add(op.reshape(op.matmul(op.reshape(y, (rows, c)), wr), (n, hw, hw, c)), r))

    lowered, ex = _build(make_module([x, w1, b1, w2, b2, g, r, wr], body))
    funcs = _primfuncs(lowered)
    matmuls = [name for name in funcs if "matmul" in name]
    assert any("gelu" in name for name in matmuls), matmuls
    assert any("multiply" in name for name in matmuls), matmuls
    assert not any("gelu" in name for name in funcs if "matmul" not in name), list(funcs)
    residual = [name for name in matmuls if "gelu" not in name and "multiply" not in name]
    assert residual and not any("epilogue" in name for name in residual), matmuls
    shapes = ((rows, c), (c, 4 * c), (4 * c,), (4 * c, c), (c,), (c,), (n, hw, hw, c), (c, c))
    args = [(rng.standard_normal(s) * 0.3).astype("float32") for s in shapes]
    (out,) = run_cpu(ex, args)
    a, wa, ba, wb, bb_, gamma, res, wres = (v.astype(np.float64) for v in args)
    y = (_gelu(a @ wa + ba) @ wb + bb_) * gamma
    np.testing.assert_allclose(out, (y @ wres).reshape(n, hw, hw, c) + res, rtol=1e-4, atol=1e-4)


def test_rows_outer_where_the_weight_fits_l2_and_the_input_does_not():
    """ConvNeXt's 6272 x 96 x 384 (weight 147 KB, input 2.4 MB) walks rows-outer with a 1 MB L2;
    BERT's 512 x 384 x 1536 (weight 2.4 MB) and a 512 x 96 x 384 whose input fits keep columns-outer."""
    spec = TargetSpec(family="cpu", arch="znver4", vector_bytes=64, vector_registers=32,
                      l1_bytes=32 << 10, l2_bytes=1 << 20)
    cases = {(6272, 96, 384): True, (512, 384, 1536): False, (512, 96, 384): False, (6272, 384, 96): False}
    for (m, k, n), rows_outer in cases.items():
        x, w = tensor("x", (m, k)), tensor("w", (k, n))
        mod = make_module([x, w], lambda bb, x, w: bb.emit(relax.op.matmul(x, w)))
        with HOST:
            (func,) = [f for _, f in relax.transform.LegalizeOps()(mod).functions_items() if isinstance(f, tirx.PrimFunc)]
        text = contraction.apply(func, HOST, spec).mod["main"].script()
        fused = "i0_0_i1_0_fused" if rows_outer else "i1_0_i0_0_fused"
        assert f"for {fused} in T.parallel(" in text, ((m, k, n), text[:2000])


def test_lanes_and_convolution_tiles():
    """56 columns (ConvNeXt's 56 x 56 images) take 8-lane vectors on AVX-512; a depthwise
    convolution holds no weight vectors, so a tile spans all 56 columns (7 vectors, 4 rows)."""
    assert contraction._lanes(56, 16) == 8
    assert contraction._lanes(384, 16) == 16 and contraction._lanes(13, 16) == 16 and contraction._lanes(None, 8) == 8
    assert contraction._tile(56, 56, 8, 32, held=0) == (4, 56)
    assert contraction._tile(56, 56, 8, 32, held=1) == (8, 8)
    assert contraction._tile(96, 6272, 16, 32) == (4, 96)


def test_depthwise_convolution_tile_spans_the_row_and_matches(rng):
    torch = pytest.importorskip("torch")
    x, w, b = tensor("x", (1, 16, 56, 56)), tensor("w", (16, 1, 7, 7)), tensor("b", (1, 16, 1, 1))
    mod = make_module([x, w, b], lambda bb, x, w, b: bb.emit(
        relax.op.add(relax.op.nn.conv2d(x, w, padding=3, groups=16), b)))
    lowered, ex = _build(mod)
    (conv,) = [f for name, f in _primfuncs(lowered).items() if "conv" in name]
    if TargetSpec.from_target(HOST).vector_bytes == 64:
        text = conv.script()
        assert "T.vectorized(T.int64(8))" in text and "T.unroll(T.int64(7))" in text  # 7 vectors of 8 lanes
    a = rng.standard_normal((1, 16, 56, 56)).astype("float32")
    wt, bias = rng.standard_normal((16, 1, 7, 7)).astype("float32"), rng.standard_normal((1, 16, 1, 1)).astype("float32")
    (out,) = run_cpu(ex, [a, wt, bias])
    want = torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(wt), padding=3, groups=16).numpy()
    np.testing.assert_allclose(out, want + bias, rtol=1e-4, atol=1e-4)


def test_reshape_of_symbolic_size_falls_back_out_of_the_matmul_and_matches_where_tiles_straddle_rows():
    """A Linear + GELU over (2, s, 64), s symbolic: the reshape back to 3-D keeps its label, the GELU runs
    in a kernel of its own, and the result is right at a length whose rows straddle the matmul's row tiles
    (s = 77). Joined to the matmul, the GELU would be placed under the tile by TVM's region of the
    reshape's `floordiv`/`floormod` by s, the box of the tile's first and last rows only: rows of the tile
    that cross into the next sequence are left unwritten (rewrites/cpu_epilogue.py)."""
    import torch

    from tvm_stitch.frontend import from_torch
    from tvm_stitch.tools.build import build

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU()).eval()
    mod = from_torch(model, (torch.randn(2, 16, 64),), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=128)},))
    built = build(mod, HOST, stitched=True)
    matmuls = [name for name in _primfuncs(built.lowered) if "matmul" in name]
    assert matmuls and not any("epilogue" in name or "gelu" in name for name in matmuls), matmuls
    for length in (16, 77):
        x = torch.randn(2, length, 64)
        (out,) = run_cpu(built.executable, [x.numpy()])
        np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-4, atol=1e-4)
