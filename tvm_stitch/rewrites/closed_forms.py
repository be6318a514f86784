"""Values that depend on the function's sizes alone, computed from their indices or sliced from a table.

A transformers decoder exported with a symbolic sequence length `s` builds
its packed-sequence check and causal mask from `arange(0, s)`: a `diff`
(slices of a `concat`), a `not_equal`, a `cumsum`, gathers of it and
comparisons, a `where`; LLaMA's rotary cos and sin from `arange(0, s)`
times a constant. With a static length FoldHostConstants evaluates them at
compile time; with `s` symbolic they run every call (a kernel for the
check, TVM's GPU scan for the cumsum: four launches, the mask's kernel, the
rotary kernel), although they read no input of the model.

This pass (before library dispatch, on every target) derives the closed
form of each binding that reads no parameter (analysis/closed_form) and
replaces each such binding that something else reads, of a symbolic shape
or cheap (below; a static mask over FoldHostConstants' limit), unless it is
a constant already:
- an element of arithmetic, comparisons and selects alone (the mask: a
  select of its two indices; the check's cumsum of a provably constant
  summand is gone): one `call_tir` of a PrimFunc with no input computing
  it, which each stitched group reading it recomputes (the partition's
  cheap producers): the mask becomes a select in the softmax's kernel;
- an element that reads no size, only its indices (a rotary table): the
  tensor at any size is the leading slice of the tensor at the sizes'
  upper bounds (the function's `tir_var_upper_bound`), evaluated once on
  the host when it is at most `max_bytes`: a `strided_slice` of that
  constant, read as a static build reads its folded constant;
- any other computable element: a kernel of no input, as above.
The bindings only other closed forms read are dropped. A binding without a
closed form (an operator outside the rules, a fact the analyzer cannot
prove), or whose element reads a constant but has no table (a size without
upper bound, a value that depends on the size), keeps its operator.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx

from tvm_stitch.analysis.closed_form import Facts
from tvm_stitch.analysis.closed_form_rules import derive
from tvm_stitch.analysis.tir_view import substitute
from tvm_stitch.rewrites.host_constants import MAX_BYTES, evaluate_bindings, read_outside, with_values


def closed_forms(func: relax.Function, facts: Facts | None = None) -> dict:
    """Relax var -> ClosedForm, for every binding of `func` that has one (in order)."""
    facts = Facts.of_function(func) if facts is None else facts
    forms = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding):
                form = derive(binding.value, forms, facts)
                if form is not None:
                    forms[binding.var] = form
    return forms


def _replaced(func: relax.Function, forms: dict) -> list:
    """The closed-form vars read by a binding without one or by the function's result, that are not
    constants already, and are of a symbolic shape or cheap (a static mask too large for
    FoldHostConstants; other static values are FoldHostConstants' and FoldConstant's)."""
    read = read_outside(func, set(forms))
    constant = {b.var for block in func.body.blocks for b in block.bindings
                if b.var in forms and isinstance(b.value, tvm.ir.Constant)}
    return [v for v in forms if v in read and v not in constant
            and (forms[v].cheap or any(not isinstance(d, tirx.IntImm) for d in forms[v].shape))]


def _kernel_call(bb: relax.BlockBuilder, form, name: str) -> relax.Call:
    return bb.call_te(lambda: te.compute(form.shape, lambda *idx: form.at(idx), name=name),
                      primfunc_name_hint=name)


def _at_bounds(expr, facts: Facts):
    """`expr` with every size at its upper bound, or None where a size it reads has none."""
    sizes = tirx.analysis.undefined_vars(expr)
    if any(facts.bounds.get(v, (0, None))[1] is None for v in sizes):
        return None
    return substitute(expr, {v: tirx.IntImm(str(v.ty), facts.bounds[v][1]) for v in sizes})


def table_shape(form, facts: Facts, max_bytes: int):
    """The static shape at the sizes' upper bounds of which `form` at any size is the leading slice,
    or None (sizes read by the element, an unbounded size, not monotone, or over `max_bytes`)."""
    if not form.sizes_free():
        return None
    shape = []
    with facts.over((), ()):
        for extent in form.shape:
            bound = _at_bounds(extent, facts)
            if bound is None or not facts.proves(extent <= bound):
                return None
            shape.append(int(facts.analyzer.simplify(bound)))
    if math.prod(shape) * max(1, tvm.DataType(form.dtype).bits // 8) > max_bytes:
        return None
    return tuple(shape)


def _needed(func: relax.Function, outputs: list, forms: dict) -> list:
    """The bindings of `func` the `outputs` depend on (all of closed form), in order."""
    value = {b.var: b for block in func.body.blocks for b in block.bindings}
    wanted, stack = set(), list(outputs)
    while stack:
        var = stack.pop()
        if var not in wanted:
            wanted.add(var)
            stack.extend(v for v in relax.analysis.free_vars(value[var].value) if v in forms)
    return [b for block in func.body.blocks for b in block.bindings if b.var in wanted]


def tables_at_bounds(func: relax.Function, outputs: list, forms: dict, facts: Facts) -> list:
    """numpy values of `outputs` at the sizes' upper bounds, computed on the host by their bindings."""
    sizes = sorted(facts.bounds, key=lambda v: v.name)
    values = [facts.bounds[v][1] if facts.bounds[v][1] is not None else facts.bounds[v][0] for v in sizes]
    return evaluate_bindings(_needed(func, outputs, forms), outputs, [relax.Var("sizes", relax.ShapeType(sizes))],
                             (tvm.runtime.ShapeTuple(values),))


def _slice_of(bb: relax.BlockBuilder, table, form) -> relax.Expr:
    axes = [k for k, d in enumerate(form.shape) if not isinstance(d, tirx.IntImm)]
    return bb.normalize(relax.op.strided_slice(relax.const(table, form.dtype), axes, [0] * len(axes),
                                               [form.shape[k] for k in axes], assume_inbound=True))


@tvm.transform.module_pass(opt_level=0, name="ComputeClosedForms")
class ComputeClosedForms:
    """Bindings of sizes alone as kernels of no input or slices of tables (module docstring).

    `max_bytes`: the largest table evaluated on the host (FoldHostConstants' limit by default)."""

    def __init__(self, max_bytes: int = MAX_BYTES, report=None):
        self.max_bytes = max_bytes
        self.report = report  # a StitchReport: what each function replaced

    def _replacements(self, bb, func: relax.Function) -> dict:
        facts = Facts.of_function(func)
        forms = closed_forms(func, facts)
        kernels, tables = {}, {}
        for var in _replaced(func, forms):
            form = forms[var]
            shape = None if form.cheap else table_shape(form, facts, self.max_bytes)
            if shape is not None:
                tables[var] = shape
            elif form.computable:
                kernels[var] = _kernel_call(bb, form, "closed_form")
        if tables:
            for var, table in zip(tables, tables_at_bounds(func, list(tables), forms, facts)):
                kernels[var] = _slice_of(bb, table, forms[var])
        if kernels and self.report is not None:
            self.report.notes.append(
                f"{len(forms)} bindings of sizes alone in closed form: {len(kernels) - len(tables)} computed by "
                f"kernels with no input, {len(tables)} sliced from tables evaluated at the sizes' bounds")
        return kernels

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            replaced = self._replacements(bb, func)
            if replaced:
                updates[gv] = with_values(func, replaced)
        if not updates:
            return mod
        out = bb.get()
        for gv, func in updates.items():
            out[gv] = func
        return out
