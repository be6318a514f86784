"""Epilogue relabels priced in time (rewrites/epilogue_price.py): a copy that makes dlight's schedule of
the compute kernel slower than the kernel and a streaming copy apart stays a kernel, with both
figures noted; a cheap one still joins the kernel."""

import tvm
from tvm import relax

from tvm_stitch.rewrites.epilogue_price import EpiloguePricer
from tvm_stitch.rewrites.matmul_epilogue import RelabelMatmulEpilogues
from tvm_stitch.report import StitchReport
from tvm_stitch.tools.launches import primfunc_calls

from conftest import CUDA, legalized, make_module, tensor

op = relax.op


def _depthwise_then_transpose(batch: int, channels: int, side: int):
    """ConvNeXt's block start: a 7x7 depthwise convolution, its bias, then NCHW -> NHWC."""
    x, w = tensor("x", (batch, channels, side, side)), tensor("w", (channels, 1, 7, 7))
    bias = tensor("b", (1, channels, 1, 1))

    def body(bb, x, w, bias):
        conv = op.nn.conv2d(x, w, padding=[3, 3, 3, 3], groups=channels)
        return bb.emit(op.permute_dims(op.add(conv, bias), [0, 2, 3, 1]))

    return legalized(make_module([x, w, bias], body))


def _matmul_then_reshape():
    x, w = tensor("x", (16, 32)), tensor("w", (32, 32))

    def body(bb, x, w):
        return bb.emit(op.reshape(op.matmul(x, w), (2, 8, 32)))

    return legalized(make_module([x, w], body))


def _relabelled(mod, report=None):
    return primfunc_calls(RelabelMatmulEpilogues(EpiloguePricer(CUDA, report))(mod))


def test_a_small_epilogue_still_joins_the_matmul():
    # Launch-bound: fused, the reshape costs the matmul nothing the model sees and saves a launch.
    report = StitchReport()
    calls = _relabelled(_matmul_then_reshape(), report)
    assert "reshape_epilogue" in calls and "reshape" not in calls
    assert not report.notes


def test_a_transpose_after_the_depthwise_convolution_is_relabelled_when_the_caches_serve_its_windows():
    # Fused, dlight schedules 448 blocks that each walk 5376 outputs; apart, a block per output (2.4 M
    # blocks). Priced as a contraction (its window loads mostly cache hits, pricing/contraction.py), the
    # fused kernel is bound by its arithmetic and barriers, far below the 2280 waves of the kernel apart.
    report = StitchReport()
    calls = _relabelled(_depthwise_then_transpose(8, 96, 56), report)
    assert "transpose_epilogue" in calls and "transpose" not in calls and not report.notes


def test_without_a_pricer_every_epilogue_is_relabelled():
    calls = primfunc_calls(RelabelMatmulEpilogues()(_depthwise_then_transpose(8, 96, 56)))
    assert "transpose_epilogue" in calls and "transpose" not in calls


def test_a_copy_of_symbolic_size_is_not_priced_and_is_relabelled():
    rows = tvm.tirx.Var("rows", "int64")
    x, w = tensor("x", (rows, 32)), tensor("w", (32, 32))

    def body(bb, x, w):
        return bb.emit(op.permute_dims(op.matmul(x, w), [1, 0]))

    report = StitchReport()
    assert "transpose_epilogue" in _relabelled(legalized(make_module([x, w], body)), report)
    assert not report.notes
