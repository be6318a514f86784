"""Prologue folds priced in time (pricing/fold_price.py): a fold the time model prices above the
matmul and its producers apart stays apart (FoldPrice), a cheap one folds."""

import numpy as np
import pytest
from tvm import relax

from tvm_stitch.pricing.fold_price import FoldPrice, fold_price
from tvm_stitch.rewrites.matmul_prologue import FoldProloguesIntoMatmuls
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.tools.launches import primfunc_calls

from conftest import CUDA, legalized, make_module, tensor

op = relax.op


def _rotary_matmul(rows: int, d: int, n: int):
    """x * cos + rotate_half(x) * sin (slices, negation, concat: a gather), then @ w."""
    x, w = tensor("x", (rows, d)), tensor("w", (d, n))
    rng = np.random.default_rng(0)
    cos, sin = (relax.const(rng.standard_normal((rows, d)).astype("float32")) for _ in range(2))

    def body(bb, x, w):
        half = d // 2
        rotated = op.concat([op.negative(op.strided_slice(x, [1], [half], [d])), op.strided_slice(x, [1], [0], [half])],
                            axis=1)
        return bb.emit(op.matmul(op.add(op.multiply(x, cos), op.multiply(rotated, sin)), w))

    return legalized(make_module([x, w], body))


def test_a_small_rotary_embedding_folds_whole():
    # Launch-bound: the fold saves the producers' launch and costs the matmul nothing it can see.
    calls = primfunc_calls(FoldProloguesIntoMatmuls(CUDA)(_rotary_matmul(16, 16, 16)))
    assert list(calls) == ["matmul_prologue"]


def test_a_gather_the_matmul_recomputes_from_the_l2_folds():
    # 512 x 64 @ 64 x 512: the folded matmul's tiles load the rotary embedding's inputs (x twice, the two
    # tables) per element, but they fit the L2: its tile loads wait for device memory only for the bytes
    # the L2 does not serve (pricing/contraction.py), so the fold costs less than the producers' own
    # launch and round trip.
    report = StitchReport()
    calls = primfunc_calls(FoldProloguesIntoMatmuls(CUDA, report)(_rotary_matmul(512, 64, 512)))
    assert list(calls) == ["matmul_prologue"] and not report.notes
    spec = TargetSpec.from_target(CUDA)
    mod = _rotary_matmul(512, 64, 512)
    (matmul,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("matmul")]
    price = fold_price(matmul, matmul, 3 * 512 * 64 * 4, CUDA, spec)
    assert 0 < price.folded_us <= price.apart_us and price.pays


@pytest.mark.parametrize("folded,apart,pays", [(5.0, 6.0, True), (6.0, 6.0, True), (7.0, 6.0, False),
                                               (-1.0, 6.0, True), (7.0, -1.0, True)])
def test_a_side_that_cannot_be_priced_folds_as_before(folded, apart, pays):
    assert FoldPrice(folded, apart).pays is pays


def test_producers_of_unknown_size_are_not_priced():
    mod = _rotary_matmul(16, 16, 16)
    (matmul,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("matmul")]
    price = fold_price(matmul, matmul, -1, CUDA, TargetSpec.from_target(CUDA))
    assert price.apart_us == -1.0 and price.folded_us > 0 and price.pays
