"""The bounds of a fused PrimFunc's symbolic sizes, carried from its Relax function as data.

`torch.export.Dim("s", min=2, max=128)` reaches the Relax function as its
`tir_var_lower_bound` / `tir_var_upper_bound` attributes. An outlined group's
PrimFunc has sizes of its own (a `s` of its parameter shapes, or of a scalar
parameter), each matched with the caller's expression passed for it; its
bounds are those of that expression. They travel on the PrimFunc's attribute
`tvm_stitch.size_bounds` ({name: [lower, upper]}, upper -1 when unbounded),
where the planner reads them.
"""

from __future__ import annotations

from tvm import relax, sym, tirx
from tvm.ir import PrimType, Range

from tvm_stitch.analysis.closed_form import Facts
from tvm_stitch.analysis.tir_view import substitute, vars_in

ATTR = "tvm_stitch.size_bounds"
UNBOUNDED = -1


def function_bounds(func: relax.Function) -> dict:
    """{size name: (lower, upper or None)} of the sizes in a Relax function's parameter shapes,
    from its `tir_var_*_bound` attributes (closed_form.Facts reads them)."""
    return {var.name: bounds for var, bounds in Facts.of_function(func).bounds.items()}


def _range(expr, bounds: dict) -> tuple:
    """(lower, upper or None) of an integer expression over sizes of `bounds` (by name); sizes not
    named there are taken as >= 0 and unbounded."""
    analyzer = sym.Analyzer()
    for var in vars_in(expr):
        low, high = bounds.get(var.name, (0, None))
        if high is not None:
            dtype = str(var.ty)
            analyzer.bind(var, Range.from_min_extent(tirx.IntImm(dtype, low), tirx.IntImm(dtype, high - low + 1)))
    found = analyzer.const_int_bound(expr)
    upper = None if found.max_value >= sym.ConstIntBound.POS_INF else int(found.max_value)
    return max(0, int(found.min_value)), upper


def upper_bound(expr, bounds: dict) -> int | None:
    """The largest value `expr` takes for sizes within `bounds` ({name: (lower, upper or None)})."""
    return _range(expr, bounds)[1]


def with_size_bounds(func: tirx.PrimFunc, args: list, caller_bounds: dict) -> tirx.PrimFunc:
    """`func` with the bounds of its sizes, matched through `args` (the Relax expressions passed for
    its inputs, in order) to the caller's sizes and their `caller_bounds`; unchanged when none is
    bounded."""
    if not caller_bounds:
        return func
    found: dict = {}

    def meet(var, expr):
        if not isinstance(var, tirx.Var):
            return
        low, high = _range(expr, caller_bounds)
        if var.name in found and found[var.name] != (low, high):
            old_low, old_high = found[var.name]
            # Two sizes of one name: bounds that hold for both.
            high = None if high is None or old_high is None else max(high, old_high)
            low = min(low, old_low)
        found[var.name] = (low, high)

    for param, arg in zip(func.params, args):
        if isinstance(param.ty, tirx.BufferType):
            shape = getattr(arg.ty, "shape", None)
            if isinstance(shape, relax.ShapeExpr):
                for dim, value in zip(param.ty.shape, shape.values):
                    meet(dim, value)
        elif isinstance(getattr(arg, "ty", None), PrimType):  # a size passed as a scalar
            meet(param, getattr(arg, "value", arg))
    bounded = {name: [low, UNBOUNDED if high is None else high] for name, (low, high) in found.items()
               if high is not None or low > 0}
    return func.with_attr(ATTR, bounded) if bounded else func


def size_bounds(func: tirx.PrimFunc) -> dict:
    """{size name: (lower, upper or None)} that `with_size_bounds` recorded on `func`."""
    recorded = func.attrs.get(ATTR) if func.attrs is not None else None
    if not recorded:
        return {}
    return {str(name): (int(pair[0]), None if int(pair[1]) == UNBOUNDED else int(pair[1]))
            for name, pair in recorded.items()}


def sizes(func: tirx.PrimFunc) -> dict:
    """{name: Var} of the symbolic sizes of `func`'s parameter shapes and scalar parameters, in order."""
    found = {}
    for param in func.params:
        dims = param.ty.shape if isinstance(param.ty, tirx.BufferType) else [param]
        for var in (v for d in dims for v in tirx.analysis.undefined_vars(d)):
            found.setdefault(var.name, var)
    return found


def at_sizes(func: tirx.PrimFunc, values: dict) -> tirx.PrimFunc:
    """`func` with its symbolic sizes set to `values` ({name: int}, every size of its buffer
    parameters; sizes passed as scalar parameters, or found only inside composite extents such
    as `2 * s`, are not supported: ValueError)."""
    found = sizes(func)
    missing = sorted(set(found) - set(values))
    scalars = [str(p.name) for p in func.params if not isinstance(p.ty, tirx.BufferType)]
    if missing or scalars:
        raise ValueError("cannot set the kernel's sizes: "
                         + (f"no value for {', '.join(missing)}" if missing else
                            f"sizes passed as scalar parameters ({', '.join(scalars)})"))

    def static(dim):
        return substitute(dim, {v: tirx.IntImm(str(v.ty), values[v.name]) for v in vars_in(dim) if v.name in values})

    # TVM specialises a buffer whose extents are constants or sizes alone; the sizes it binds
    # there are substituted in the other buffers too.
    plain = [p for p in func.params if all(isinstance(d, (tirx.IntImm, tirx.Var)) for d in p.ty.shape)]
    unbound = set(found) - {d.name for p in plain for d in p.ty.shape if isinstance(d, tirx.Var)}
    if unbound:
        raise ValueError(f"cannot set the kernel's sizes: {', '.join(sorted(unbound))} only inside composite extents")
    buffers = {p: tirx.decl_buffer([static(d) for d in p.ty.shape], p.ty.dtype, p.name) for p in plain}
    return func.specialize(buffers)


def at_upper_bounds(func: tirx.PrimFunc) -> tuple:
    """(func with every symbolic size of its parameters set to its upper bound, {name: bound}), or
    (None, {}) when there is no size, some size has no upper bound, or `at_sizes` cannot set one."""
    bounds, found = size_bounds(func), sizes(func)
    if (not found or any(bounds.get(name, (0, None))[1] is None for name in found)
            or any(not isinstance(p.ty, tirx.BufferType) for p in func.params)):
        return None, {}
    values = {name: bounds[name][1] for name in found}
    try:
        return at_sizes(func, values), values
    except ValueError:
        return None, {}
