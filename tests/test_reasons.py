"""Reasons are codes with parameters, rendered to prose in one place."""

import pytest

from tvm_stitch.planning.reasons import PlanError, Reason, reason_of
from tvm_stitch.planning.row_split import SplitError


def test_a_plan_error_carries_its_code_and_parameters_and_renders_them():
    err = SplitError("split-resident-fits", rows=64, length=96)
    assert isinstance(err, PlanError) and err.code == "split-resident-fits"
    assert err.params == {"rows": 64, "length": 96}
    assert str(err) == err.reason.text == "64 rows of 96 elements: row-resident fits"
    assert reason_of(err) is err.reason


def test_a_reason_of_reasons_renders_both():
    resident = Reason("shared-memory-exceeded", {"bytes": 65600, "limit": 49152})
    both = PlanError("no-scheme", row_resident=resident, row_split=Reason("split-symbolic-rows"))
    assert both.params["row_resident"].code == "shared-memory-exceeded"
    assert str(both) == ("65600 bytes of shared memory per row (intermediates, cached inputs, reduction staging) "
                         "exceed 49152 of shared memory; and no row-split plan: symbolic row count")


def test_an_unknown_code_is_refused():
    with pytest.raises(ValueError, match="unknown reason code"):
        PlanError("no-such-code")


def test_any_other_failure_is_the_error_reason_with_its_type_and_last_line():
    reason = reason_of(RuntimeError("TVM traceback\n  frame\nInternalError: the schedule is invalid"))
    assert reason.code == "error"
    assert reason.params == {"type": "RuntimeError", "message": "InternalError: the schedule is invalid"}
    assert reason.text == "RuntimeError: InternalError: the schedule is invalid"


def test_a_tvm_error_followed_by_its_pass_and_tvmscript_gives_its_own_line():
    message = ("Cannot decide max_value for typeT.bool\n\nError in pass: _pipeline\nLocation (TVMScript):\n"
               "Access path: <root>.functions\n\n    @T.prim_func\n    ^^^^^^^^^^^^\n"
               "        y[i] = y[i] and x[i, k]\n        ^^^^^^^^^^^^^^^^^^^^^^^")
    reason = reason_of(RuntimeError(message))
    assert reason.text == "RuntimeError: Cannot decide max_value for typeT.bool"
