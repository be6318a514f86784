"""Rotary tables computed from a symbolic length alone, read by the attention kernel from their value at
the length's upper bound.

Under a symbolic sequence length LLaMA's cos and sin tables are computed in
the graph from `arange(0, s)`. Where a table's element reads its indices
alone (no size: rewrites/closed_forms.table_shape, the rule ComputeClosedForms
slices tables by), the table at any length is the leading slice of the table
at the upper bound; that table, evaluated once on the host, is what the
kernel reads (position `row` of it), so the tables launch nothing, as in a
static build.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from tvm_stitch.analysis.attention_chain import AttentionChain
from tvm_stitch.analysis.closed_form import Facts
from tvm_stitch.analysis.shape_dims import dims, static
from tvm_stitch.rewrites.closed_forms import closed_forms, table_shape, tables_at_bounds
from tvm_stitch.rewrites.host_constants import MAX_BYTES


def with_constant_tables(func: relax.Function, chain: AttentionChain) -> AttentionChain:
    """`chain` with each rotary table of symbolic shape that is a leading slice of its value at the upper
    bounds replaced by that value (a constant), its operand views' table shapes with it."""
    symbolic = [t for t in chain.tables if isinstance(t, relax.Var) and not static(tuple(t.ty.shape.values))]
    if not symbolic:
        return chain
    facts = Facts.of_function(func)
    forms = closed_forms(func, facts)
    shapes = {t: table_shape(forms[t], facts, MAX_BYTES) if t in forms else None for t in symbolic}
    found = [t for t in symbolic if shapes[t] is not None]
    if not found:
        return chain
    try:
        values = dict(zip(found, tables_at_bounds(func, found, forms, facts)))
    except RuntimeError:  # TVM's errors derive from it; not evaluable on the host alone: the kernel reads the computed tables
        return chain
    tables = tuple(relax.const(values[t], str(t.ty.dtype)) if t in values else t for t in chain.tables)
    views, k = [], 0
    for view in chain.views:
        if view.cos:
            view = dataclasses.replace(view, cos=dims(tables[k]), sin=dims(tables[k + 1]))
            k += 2
        views.append(view)
    return dataclasses.replace(chain, tables=tables, views=tuple(views))

