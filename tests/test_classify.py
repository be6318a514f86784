"""Op classification comes from the PrimFunc's blocks, not from op names."""

import pytest
from tvm import relax

from tvm_stitch.analysis.classify import OpKind, classify_primfunc

from conftest import legalized, make_module, tensor

op = relax.op


def _classes(body, *params):
    mod = legalized(make_module(list(params), body))
    return {gv.name_hint: classify_primfunc(f) for gv, f in mod.functions_items() if gv.name_hint != "main"}


def _single(body, *params):
    classes = _classes(body, *params)
    assert len(classes) == 1, classes
    return next(iter(classes.values()))


X = (64, 96)


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda x, g: op.exp(x), OpKind.ELEMENTWISE),
        (lambda x, g: op.add(x, x), OpKind.ELEMENTWISE),
        (lambda x, g: op.astype(x, "float16"), OpKind.ELEMENTWISE),
        (lambda x, g: op.add(x, g), OpKind.BROADCAST),
        (lambda x, g: op.permute_dims(x, [1, 0]), OpKind.INJECTIVE),
        (lambda x, g: op.reshape(x, (64, 8, 12)), OpKind.INJECTIVE),
    ],
)
def test_spatial_kinds(make, kind):
    x, g = tensor("x", X), tensor("g", (96,))
    assert _single(lambda bb, x, g: bb.emit(make(x, g)), x, g).kind == kind


def test_gather_is_injective_not_opaque():
    # take legalizes with op_pattern kOpaque, but its block is a plain gather.
    x, i = tensor("x", X), tensor("i", (10,), "int64")
    cls = _single(lambda bb, x, i: bb.emit(op.take(x, i, axis=0)), x, i)
    assert cls.kind == OpKind.INJECTIVE


@pytest.mark.parametrize(
    "shape, axes, where",
    [
        ((64, 96), [1], "row"),
        ((64, 96), [0], "column"),
        ((4, 64, 96), [1], "middle"),
        ((64, 96), [0, 1], "full"),
        ((4, 64, 96), [1, 2], "row"),
    ],
)
def test_reductions(shape, axes, where):
    x = tensor("x", shape)
    cls = _single(lambda bb, x: bb.emit(op.sum(x, axis=axes)), x)
    assert cls.kind == OpKind.REDUCTION
    assert cls.reduce_where == where
    assert cls.reduce_axes == tuple(a % len(shape) for a in axes)


def test_mean_is_a_reduction_despite_op_pattern():
    # mean legalizes to sum + divide with op_pattern kOutEWiseFusable, like matmul.
    x = tensor("x", X)
    cls = _single(lambda bb, x: bb.emit(op.mean(x, axis=[1])), x)
    assert cls.kind == OpKind.REDUCTION


def test_matmul_and_conv_are_compute_intensive():
    x, w = tensor("x", (64, 96)), tensor("w", (96, 32))
    assert _single(lambda bb, x, w: bb.emit(op.matmul(x, w)), x, w).kind == OpKind.COMPUTE
    img, k = tensor("img", (1, 3, 16, 16)), tensor("k", (4, 3, 3, 3))
    assert _single(lambda bb, a, b: bb.emit(op.nn.conv2d(a, b)), img, k).kind == OpKind.COMPUTE


def test_expensive_ops_are_listed():
    x = tensor("x", X)
    cls = _single(lambda bb, x: bb.emit(op.nn.softmax(x)), x)
    assert cls.kind == OpKind.REDUCTION
    assert "exp" in cls.expensive
