"""Which leading axes ops can share as rows."""

from tvm import relax

from tvm_stitch.analysis.row_alignment import ALIGNED, CROSSING, INVARIANT, analyze_rows

from conftest import legalized, make_module, tensor

op = relax.op


def _rows(body, *params):
    mod = legalized(make_module(list(params), body))
    (func,) = [f for gv, f in mod.functions_items() if gv.name_hint != "main"]
    return analyze_rows(func)


def test_row_reduction_has_one_row_axis():
    info = _rows(lambda bb, x: bb.emit(op.sum(x, axis=[1], keepdims=True)), tensor("x", (64, 96)))
    assert info.extents[0] == 64
    assert info.param_access[0][1] == ALIGNED


def test_reshape_that_keeps_rows_is_aligned():
    info = _rows(lambda bb, x: bb.emit(op.reshape(x, (64, 8, 12))), tensor("x", (64, 96)))
    assert info.param_access[0][1] == ALIGNED
    assert info.param_access[0][2] == CROSSING


def test_transpose_crosses_rows():
    info = _rows(lambda bb, x: bb.emit(op.permute_dims(x, [1, 0])), tensor("x", (64, 64)))
    assert info.param_access[0][1] == CROSSING


def test_broadcast_vector_is_row_invariant():
    info = _rows(lambda bb, x, g: bb.emit(op.add(x, g)), tensor("x", (64, 96)), tensor("g", (96,)))
    assert info.param_access[1][1] == INVARIANT


def test_column_reduction_rows_are_columns():
    info = _rows(lambda bb, x: bb.emit(op.sum(x, axis=[0])), tensor("x", (64, 96)))
    # Its only spatial axis is the column axis: it cannot share rows with a row-wise op.
    assert info.extents[0] == 96
    assert info.param_access[0][1] == CROSSING
