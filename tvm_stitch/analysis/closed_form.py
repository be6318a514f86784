"""A tensor that depends on sizes alone, as one expression of its indices.

`ClosedForm` is plain data: a shape, a dtype, one index variable per axis,
and the element at those indices as a TIR expression of them and of the
function's symbolic sizes. `derive(value, forms, facts)` (closed_form_rules.py) gives the closed
form of a binding's value — a Relax operator call whose tensor arguments
have closed forms (`forms`: Relax var -> ClosedForm) or are constants, or a
constant — or None where the operator is not one of `RULES` or a fact it
needs cannot be proven:

- sources: `arange`, `full`, `zeros`, `ones`, constants (one value, or
  integers affine in the indices: an `arange` FoldHostConstants folded;
  any other constant is a placeholder call reading its elements, so the
  form says how it depends on the sizes but no kernel computes it);
- element-wise arithmetic, comparisons, logic, `where`, `astype` and the
  intrinsics cos, sin, exp, log, sqrt, rsqrt, tanh, sigmoid, with
  broadcasting (a size-1 axis, or one provably equal to the result's);
- index maps: `broadcast_to`, `expand_dims`, `squeeze`, `reshape`,
  `permute_dims`, `strided_slice` (positive strides, begins proven in
  bounds), `concat`;
- gathers of a closed form at closed-form indices (`take`,
  `index_tensor`) whose indices are proven in bounds;
- `cumsum` of an integer or bool summand that does not vary along the
  scanned axis (proven): the summand times the position, exact.

Every derived element is simplified by TVM's arithmetic analyzer under the
bounds of its indices (0 <= i < extent) and of the sizes (`Facts`), and
selects are decided by splitting on their conditions (a packed-sequence
check's `diff` of an `arange` is 1 on both sides of its `i == 0` select).
An element larger than `MAX_NODES` expression nodes is not a closed form.
The rules build each element from the same TIR operations as TVM's
legalization of the operator, so a kernel computing it gives the same
values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, sym, tirx

from tvm_stitch.analysis.tir_view import node_count, static_int, static_product, substitute

MAX_NODES = 200  # the largest element expression kept as a closed form
MAX_INSPECTED = 1 << 16  # constants of more elements are not read for a uniform or affine value
_TABLE = "tvm_stitch.constant_"  # a constant tensor's elements, in an element (a placeholder call)
_SPLIT_DEPTH = 4  # selects decided per simplification, by case splitting


@dataclass(frozen=True)
class ClosedForm:
    shape: tuple  # PrimExpr per axis
    dtype: str
    axes: tuple  # one tirx.Var per axis
    element: object  # PrimExpr of `axes` and the sizes

    @property
    def computable(self) -> bool:
        """Whether a kernel can compute the element (it reads no constant tensor, see `const_form`)."""
        return not any(name.startswith(_TABLE) for name in _called(self.element))

    @property
    def cheap(self) -> bool:
        """Computable with arithmetic, comparisons and selects alone (no intrinsic call)."""
        return not _called(self.element)

    def sizes_free(self) -> bool:
        """Whether the element reads no symbolic size (only its indices): the tensor at any size is a
        slice of the tensor at a larger one."""
        return all(any(v.same_as(a) for a in self.axes) for v in tirx.analysis.undefined_vars(self.element))

    def at(self, indices) -> tirx.PrimExpr:
        """The element at `indices` (one PrimExpr per axis)."""
        return substitute(self.element, dict(zip(self.axes, indices)))


def recorded_bounds(func: relax.Function) -> tuple:
    """({size name: lower bound}, {size name: upper bound}) that a Relax function's
    `tir_var_lower_bound` / `tir_var_upper_bound` attributes record (torch.export's `Dim(min, max)`)."""
    attrs = func.attrs or {}
    return tuple({str(k): int(v) for k, v in (attrs.get(key) or {}).items()}
                 for key in ("tir_var_lower_bound", "tir_var_upper_bound"))


class Facts:
    """What the analyzer may assume: the bounds of a function's sizes."""

    def __init__(self, bounds: dict):
        self.analyzer = sym.Analyzer()
        self.bounds = dict(bounds)  # tirx.Var -> (lower or None, upper or None), inclusive

    @classmethod
    def of_function(cls, func: relax.Function) -> "Facts":
        """Sizes in the parameters' shapes are >= 0, within the function's `tir_var_*_bound` attributes."""
        lower, upper = recorded_bounds(func)
        bounds = {}
        for param in func.params:
            shape = getattr(param.ty, "shape", None)
            if isinstance(shape, relax.ShapeExpr):
                for var in (v for d in shape.values for v in tirx.analysis.undefined_vars(d)):
                    bounds[var] = (max(0, lower.get(var.name, 0)), upper.get(var.name))
        return cls(bounds)

    @contextlib.contextmanager
    def over(self, axes, shape):
        """A scope where the sizes are within their bounds and each axis within its extent."""
        with contextlib.ExitStack() as stack:
            for var, (low, high) in self.bounds.items():
                stack.enter_context(self.analyzer.constraint_scope(var >= low))
                if high is not None:
                    stack.enter_context(self.analyzer.constraint_scope(var <= high))
            for axis, extent in zip(axes, shape):
                stack.enter_context(self.analyzer.constraint_scope(tirx.all(axis >= 0, axis < extent)))
            yield

    def simplify(self, expr, depth: int = _SPLIT_DEPTH):
        """`expr` simplified in the current scope, each select decided where both of its cases agree."""
        expr = self.analyzer.simplify(expr)
        conditions = _select_conditions(expr)
        if depth == 0 or not conditions:
            return expr
        with self.analyzer.constraint_scope(conditions[0]):
            yes = self.simplify(expr, depth - 1)
        with self.analyzer.constraint_scope(tirx.Not(conditions[0])):
            no = self.simplify(expr, depth - 1)
        return yes if tvm_ffi.structural_equal(yes, no) else expr

    def proves(self, condition) -> bool:
        result = self.simplify(condition)
        return isinstance(result, tirx.IntImm) and bool(result.value)

    def equal(self, a, b) -> bool:
        return self.analyzer.can_prove_equal(a, b) or self.proves(tirx.EQ(a, b))


def _select_conditions(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Select, lambda s: found.append(s.condition)), order="pre")
    return found


def _called(expr) -> list:
    """Names of the functions and intrinsics `expr` calls."""
    names = []

    def visit(call):
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name == "tirx.call_pure_extern" and isinstance(call.args[0], tvm.ir.StringImm):
            names.append(str(call.args[0].value))
        else:
            names.append(op.name if isinstance(op, tvm.ir.Op) else str(op))

    tvm_ffi.structural_walk(expr, (tvm.ir.Call, visit), order="pre")
    return names


def make(shape, dtype: str, facts: Facts, element_at) -> ClosedForm | None:
    """The closed form whose element at indices `i` is `element_at(i)`, simplified; None if too large."""
    axes = tuple(tirx.Var(f"i{k}", "int64") for k in range(len(shape)))
    zero = tirx.IntImm("int64", 0)
    with facts.over(axes, shape):
        element = facts.simplify(element_at(tuple(zero if static_int(d) == 1 else a for a, d in zip(axes, shape))))
    if node_count(element) > MAX_NODES:
        return None
    return ClosedForm(tuple(shape), str(dtype), axes, element)


def const_form(expr) -> ClosedForm | None:
    """A constant: one value, an affine function of the indices (integers), or else a placeholder
    call reading its elements (named by the constant's address: distinct constants never compare
    equal), a closed form no kernel computes but whose dependence on the sizes is known. Constants
    of over `MAX_INSPECTED` elements are placeholders unread (a model's weights)."""
    ty = expr.ty
    dtype = str(ty.dtype)
    shape = tuple(ty.shape.values)
    axes = tuple(tirx.Var(f"i{k}", "int64") for k in range(len(shape)))
    table = ClosedForm(shape, dtype, axes, tirx.call_pure_extern(dtype, f"{_TABLE}{expr.__chandle__():x}", *axes))
    elements = static_product(shape)
    if elements is None or elements > MAX_INSPECTED:
        return table
    array = expr.value.numpy()
    if array.size == 0:
        return None
    first = array.reshape(-1)[0]
    if np.all(array == first):
        return ClosedForm(shape, dtype, axes, tirx.const(first.item(), dtype))
    if not is_integer(dtype) or dtype == "bool":
        return table
    wide = array.astype(np.int64)
    steps = [int(wide[tuple(1 if j == k else 0 for j in range(wide.ndim))] - wide.reshape(-1)[0])
             if wide.shape[k] > 1 else 0 for k in range(wide.ndim)]
    grid = np.indices(wide.shape, dtype=np.int64)
    if not np.array_equal(wide, int(first) + sum(step * grid[k] for k, step in enumerate(steps))):
        return table
    element = tirx.const(int(first), "int64")
    for axis, step in zip(axes, steps):
        if step:
            element = element + axis * tirx.const(step, "int64")
    return ClosedForm(shape, dtype, axes, tirx.Cast(dtype, element) if dtype != "int64" else element)


def operand(arg, forms: dict) -> ClosedForm | None:
    if isinstance(arg, relax.Var):
        return forms.get(arg)
    if isinstance(arg, tvm.ir.Constant):
        return const_form(arg)
    return None


def result_of(call):
    ty = call.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return tuple(ty.shape.values), str(ty.dtype)


def _broadcast(form: ClosedForm, shape, facts: Facts):
    """A function from the result's indices to `form`'s, numpy broadcasting; None if not provable."""
    offset = len(shape) - len(form.shape)
    if offset < 0:
        return None
    picks = []
    for k, dim in enumerate(form.shape):
        if static_int(dim) == 1:
            picks.append(None)
        elif facts.equal(dim, shape[offset + k]):
            picks.append(offset + k)
        else:
            return None
    zero = tirx.IntImm("int64", 0)
    return lambda idx: [zero if p is None else idx[p] for p in picks]


class NotClosed(Exception):
    """A rule's operand or fact is missing: the call has no closed form."""


def need(arg, forms: dict) -> ClosedForm:
    form = operand(arg, forms)
    if form is None:
        raise NotClosed
    return form


def mapped(form: ClosedForm, shape, facts: Facts):
    mapping = _broadcast(form, shape, facts)
    if mapping is None:
        raise NotClosed
    return lambda idx: form.at(mapping(idx))


def axis_index(axis, rank: int) -> int:
    axis = int(axis)
    if not -rank <= axis < rank:
        raise NotClosed
    return axis % rank


def as_int64(value):
    return value if str(value.ty) == "int64" else tirx.Cast("int64", value)


def in_bounds(facts: Facts, index, extent) -> None:
    if not facts.proves(tirx.all(index >= 0, index < extent)):
        raise NotClosed


def is_integer(dtype: str) -> bool:
    return dtype == "bool" or dtype.startswith(("int", "uint"))


def _bitwise(logical, integral):
    return lambda a, b, dtype: logical(a, b) if dtype == "bool" else integral(a, b)


def _floor_divide(a, b, dtype):
    return tirx.floordiv(a, b) if is_integer(dtype) else tirx.floor(a / b)


def _divide(a, b, dtype):
    if is_integer(dtype):
        raise NotClosed  # TVM's integer division rounds as its own legalization says
    return a / b


_BINARY = MappingProxyType({
    "relax.add": lambda a, b, _d: a + b,
    "relax.subtract": lambda a, b, _d: a - b,
    "relax.multiply": lambda a, b, _d: a * b,
    "relax.divide": _divide,
    "relax.floor_divide": _floor_divide,
    "relax.maximum": lambda a, b, _d: tirx.Max(a, b),
    "relax.minimum": lambda a, b, _d: tirx.Min(a, b),
    "relax.equal": lambda a, b, _d: tirx.EQ(a, b),
    "relax.not_equal": lambda a, b, _d: tirx.NE(a, b),
    "relax.less": lambda a, b, _d: tirx.LT(a, b),
    "relax.less_equal": lambda a, b, _d: tirx.LE(a, b),
    "relax.greater": lambda a, b, _d: tirx.GT(a, b),
    "relax.greater_equal": lambda a, b, _d: tirx.GE(a, b),
    "relax.logical_and": lambda a, b, _d: tirx.And(a, b),
    "relax.logical_or": lambda a, b, _d: tirx.Or(a, b),
    "relax.bitwise_and": _bitwise(tirx.And, tirx.bitwise_and),
    "relax.bitwise_or": _bitwise(tirx.Or, tirx.bitwise_or),
})


def _binary(call, forms, facts, shape, dtype):
    a, b = (need(arg, forms) for arg in call.args)
    if a.dtype != b.dtype:
        raise NotClosed
    fa, fb = mapped(a, shape, facts), mapped(b, shape, facts)
    op = _BINARY[call.op.name]
    return make(shape, dtype, facts, lambda idx: op(fa(idx), fb(idx), a.dtype))


def _unary(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    name = call.op.name
    if name == "relax.astype":
        return make(shape, dtype, facts, lambda idx: tirx.Cast(dtype, x.at(idx)))
    if name == "relax.negative":
        return make(shape, dtype, facts, lambda idx: -x.at(idx))
    if name in _INTRINSICS:
        return make(shape, dtype, facts, lambda idx: _INTRINSICS[name](x.at(idx)))
    return make(shape, dtype, facts, lambda idx: tirx.Not(x.at(idx)))  # logical_not


_INTRINSICS = MappingProxyType({f"relax.{f.__name__}": f for f in (
    tirx.cos, tirx.sin, tirx.exp, tirx.log, tirx.sqrt, tirx.rsqrt, tirx.tanh, tirx.sigmoid)})


def _where(call, forms, facts, shape, dtype):
    cond, a, b = (mapped(need(arg, forms), shape, facts) for arg in call.args)
    return make(shape, dtype, facts, lambda idx: tirx.Select(cond(idx), a(idx), b(idx)))


def _arange(call, _forms, facts, shape, dtype):
    start, _end, step = call.args
    if not all(tvm.ir.is_prim_expr(v) and is_integer(str(v.ty)) for v in (start, step)):
        raise NotClosed
    return make(shape, dtype, facts, lambda idx: tirx.Cast(dtype, start + step * idx[0]))


def _full(call, _forms, facts, shape, dtype):
    if call.op.name in ("relax.zeros", "relax.ones"):
        value = tirx.const(0 if call.op.name == "relax.zeros" else 1, dtype)
    else:
        fill = call.args[1]
        if not isinstance(fill, tvm.ir.Constant) or fill.value.numpy().size != 1:
            raise NotClosed
        value = tirx.Cast(dtype, tirx.const(fill.value.numpy().reshape(()).item(), str(fill.ty.dtype)))
    return make(shape, dtype, facts, lambda _idx: value)


ELEMENTWISE_RULES = MappingProxyType({
    **{name: _binary for name in _BINARY},
    **{name: _unary for name in ("relax.astype", "relax.negative", "relax.logical_not", *_INTRINSICS)},
    "relax.where": _where,
    "relax.arange": _arange,
    **{name: _full for name in ("relax.full", "relax.zeros", "relax.ones")},
})
