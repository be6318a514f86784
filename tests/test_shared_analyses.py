"""The planners of one kernel share block views, inlining trials and analyses (planning.common.Analyses)."""

import pytest
from tvm import relax, tirx

from tvm_stitch.planning.common import Analyses, PlanError, inline_trial, views
from tvm_stitch.planning.cuda.column_split import ColumnError
from tvm_stitch.planning.row_split import SplitError

from conftest import legalized, make_module, tensor


def _softmax():
    mod = legalized(make_module([tensor("x", (64, 32))], lambda bb, x: relax.op.nn.softmax(x, axis=-1)))
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return func


def test_a_trial_is_made_once_and_a_refusal_raises_each_callers_error():
    func, analyses = _softmax(), Analyses()
    trial = inline_trial(func, ["T_softmax_exp"], SplitError, analyses)
    assert inline_trial(func, ["T_softmax_exp"], ColumnError, analyses) is trial
    assert [v.name for v in trial[1]] == ["T_softmax_maxelem", "T_softmax_expsum", "T_softmax_norm"]
    # inlining nothing: the function's own views, made once
    assert inline_trial(func, [], analyses=analyses)[1] is views(func, analyses)
    for error in (SplitError, ColumnError):  # a reduction is not inlined
        with pytest.raises(error, match="T_softmax_maxelem"):
            inline_trial(func, ["T_softmax_maxelem"], error, analyses)


def test_what_raised_a_plan_error_raises_it_again_without_being_made_again():
    func, analyses, made = _softmax(), Analyses(), []

    def refuse():
        made.append(1)
        raise PlanError("no-blocks")

    for _ in range(2):
        with pytest.raises(PlanError):
            analyses.made(func, ("refused",), refuse)
    assert made == [1]
    assert analyses.made(func, ("other",), lambda: 7) == 7 and analyses.made(func, ("other",), lambda: 8) == 7
