"""Tensor dimensions as the attention analysis reads them, static or symbolic.

A dimension is an `int` where the shape says a constant, else the simplified
TIR expression of the Relax shape (a sequence length `s`, the rows `s * 2`
of a batch of 2). Two dimensions are the same only where they are equal
ints or the analyzer proves the expressions equal, so a check that needs a
match refuses what it cannot prove; products and ceilings stay expressions
where a factor is symbolic.
"""

from __future__ import annotations

import re

from tvm import relax, sym, tirx


UNBOUNDED_SIZE = 1024  # the value a symbolic size without an upper bound is planned and priced at


def dims(expr) -> tuple | None:
    """The dimensions of a Relax expression's tensor type (ints, PrimExprs), None without a shape."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    analyzer = sym.Analyzer()
    return tuple(_int_or(analyzer.simplify(d)) for d in ty.shape.values)


def _int_or(expr):
    return int(expr) if isinstance(expr, tirx.IntImm) else expr


def is_static(dim) -> bool:
    return isinstance(dim, int)


def static(shape: tuple) -> bool:
    return all(is_static(d) for d in shape)


def same(a, b) -> bool:
    """Whether two dimensions (or tuples of them) are provably equal."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if is_static(a) and is_static(b):
        return a == b
    return bool(sym.Analyzer().can_prove_equal(a, b))


def product(shape) -> object:
    """The number of elements of `shape` (an int, or an expression where a dimension is symbolic)."""
    n = 1
    for d in shape:
        n = n * d
    return n if is_static(n) else _int_or(sym.Analyzer().simplify(n))


def divides(a, b) -> bool:
    """Whether `a` provably divides `b` (dimensions)."""
    if is_static(a) and is_static(b):
        return a != 0 and b % a == 0
    return same(_int_or(sym.Analyzer().simplify(tirx.floormod(b, a))), 0)


def at_least(a, b) -> bool:
    """Whether `a >= b` is proved (ints, or expressions over sizes taken as non-negative)."""
    if is_static(a) and is_static(b):
        return a >= b
    return bool(sym.Analyzer().can_prove(tirx.const(a, "int64") >= b if is_static(a) else a >= b))


def ceil_div(a, tile: int):
    """ceil(a / tile) of a dimension."""
    return -(-a // tile) if is_static(a) else _int_or(sym.Analyzer().simplify((a + (tile - 1)) // tile))


def text(dim) -> str:
    """A dimension as the plan's lines print it: `128`, `s`, `(s + 63) // 64 * 24`."""
    return re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", str(dim))


def at_values(dim, values: dict) -> int:
    """A dimension's value with its symbolic sizes at `values` ({name: int}); ValueError where one is missing."""
    if is_static(dim):
        return dim
    analyzer = sym.Analyzer()
    for var in tirx.analysis.undefined_vars(dim, []):
        if var.name not in values:
            raise ValueError(f"{dim}: no value for the size {var.name}")
        analyzer.bind(var, tirx.IntImm(str(var.ty), values[var.name]))
    value = analyzer.simplify(dim)
    if not isinstance(value, tirx.IntImm):
        raise ValueError(f"{dim} is not an integer at {values}")
    return int(value)


def sizes_in(shapes) -> list:
    """The names of the symbolic sizes in some shapes (tuples of dimensions), in order of appearance."""
    names = {}
    for shape in shapes:
        for dim in shape:
            if not is_static(dim):
                names.update((var.name, None) for var in tirx.analysis.undefined_vars(dim, []))
    return list(names)


def priced_sizes(names, bounds: dict) -> tuple:
    """((name, value), ...): each symbolic size at its upper bound in `bounds` ({name: (lower, upper or
    None)}, a Relax function's), UNBOUNDED_SIZE (at least its lower bound) where it has none: the sizes
    a kernel of symbolic sizes is planned and priced at."""
    out = []
    for name in names:
        low, high = bounds.get(name, (0, None))
        out.append((name, high if high is not None else max(UNBOUNDED_SIZE, low or 0)))
    return tuple(out)
