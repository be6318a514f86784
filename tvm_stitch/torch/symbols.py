"""Dynamo's symbolic sizes (sympy expressions of its ShapeEnv) as TIR, with their bounds, and their values at a call.

A size symbol `s33` becomes the int64 TIR variable `s33`; sums, products,
floor divisions and modulos of symbols and integers become the TIR
expression. The bounds dynamo knows (`mark_dynamic(x, 1, min=2, max=128)`,
or what its guards proved) become the Relax function's
`tir_var_lower_bound` / `tir_var_upper_bound`, which the stitched symbolic
kernels are planned for.
"""

from __future__ import annotations

import math

from tvm import tirx

from tvm_stitch.torch.errors import UnsupportedSize


def is_symbolic(value) -> bool:
    return type(value).__name__ in ("SymInt", "SymFloat", "SymBool")


def expression(value):
    """The sympy expression of a SymInt (an int stays an int)."""
    return value.node.expr if is_symbolic(value) else value


def to_tir(expr, variables: dict):
    """A sympy expression of size symbols as TIR; `variables` (name -> tirx.Var) grows with new symbols."""
    import sympy

    if isinstance(expr, int) or (isinstance(expr, sympy.Integer)):
        return tirx.IntImm("int64", int(expr))
    if isinstance(expr, sympy.Symbol):
        return variables.setdefault(str(expr), tirx.Var(str(expr), "int64"))
    args = [to_tir(a, variables) for a in expr.args]
    name = type(expr).__name__
    if isinstance(expr, sympy.Add):
        return _fold(args, lambda a, b: a + b)
    if isinstance(expr, sympy.Mul):
        return _fold(args, lambda a, b: a * b)
    if name == "FloorDiv":
        return tirx.floordiv(*args)
    if name in ("Mod", "PythonMod"):
        return tirx.floormod(*args)
    if isinstance(expr, sympy.Max):
        return _fold(args, tirx.max)
    if isinstance(expr, sympy.Min):
        return _fold(args, tirx.min)
    raise UnsupportedSize(f"symbolic size {expr} ({name}) has no TIR form here")


def _fold(args, combine):
    out = args[0]
    for a in args[1:]:
        out = combine(out, a)
    return out


def bounds(shape_env, names) -> tuple[dict, dict]:
    """(lower, upper) bounds of the named symbols that dynamo's ShapeEnv knows; an unbounded upper is left out."""
    import sympy

    lower, upper = {}, {}
    if shape_env is None:
        return lower, upper
    for name in names:
        found = shape_env.var_to_range.get(sympy.Symbol(name, integer=True, positive=True))
        if found is None:
            found = next((r for s, r in shape_env.var_to_range.items() if str(s) == name), None)
        if found is None:
            continue
        low, high = found.lower, found.upper
        if _finite(low):
            lower[name] = int(low)
        if _finite(high):
            upper[name] = int(high)
    return lower, upper


def _finite(value) -> bool:
    try:
        return not math.isinf(float(value))
    except (TypeError, ValueError):
        return False


def shape_env_of(values):
    """The ShapeEnv behind the fake tensors and SymInts of a graph's example inputs (None when all are static)."""
    for value in values:
        if is_symbolic(value):
            return value.node.shape_env
        mode = getattr(value, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return None


def binders(values) -> dict:
    """Where each plain size symbol can be read at a call: name -> (input index, dim or None for a SymInt input)."""
    import sympy

    found = {}
    for index, value in enumerate(values):
        if is_symbolic(value) and isinstance(expression(value), sympy.Symbol):
            found.setdefault(str(expression(value)), (index, None))
        for dim, size in enumerate(getattr(value, "shape", ())):
            if is_symbolic(size) and isinstance(expression(size), sympy.Symbol):
                found.setdefault(str(expression(size)), (index, dim))
    return found


def evaluate(expr, values: dict) -> int:
    """An expression's value given each symbol's (name -> int)."""
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace({s: values[str(s)] for s in expr.free_symbols}))
