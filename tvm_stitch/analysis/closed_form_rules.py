"""The closed form of a binding's value: the rule of its operator (closed_form.py's module docstring)."""

from __future__ import annotations

from types import MappingProxyType

import tvm
from tvm import relax

from tvm_stitch.analysis.closed_form import ELEMENTWISE_RULES, ClosedForm, Facts, NotClosed, const_form, result_of
from tvm_stitch.analysis.closed_form_indexing import INDEXING_RULES

RULES = MappingProxyType({**ELEMENTWISE_RULES, **INDEXING_RULES})


def derive(call, forms: dict, facts: Facts) -> ClosedForm | None:
    """The closed form of a binding's value `call` (module docstring), or None."""
    if isinstance(call, tvm.ir.Constant):
        return const_form(call)
    if isinstance(call, relax.Var):
        return forms.get(call)
    if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op) or call.op.name not in RULES:
        return None
    result = result_of(call)
    if result is None:
        return None
    try:
        return RULES[call.op.name](call, forms, facts, *result)
    except NotClosed:
        return None
