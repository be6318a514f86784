"""The concrete sizes a kernel of symbolic shape is checked at, and its expressions at those sizes.

A symbolic variable of a kernel's parameters (a batch, a sequence length,
the rows b*s of both) gets three values: its lower bound (1 where none is
recorded), an odd value that is a multiple of no warp or block size (ODD,
or the odd value nearest it within the bounds), and its upper bound
(UNBOUNDED_LARGE where none is recorded). Relax functions record the
bounds in their `tir_var_lower_bound` / `tir_var_upper_bound` attributes
(torch.export's `Dim(min=, max=)` arrive there); values the caller gives
win. A kernel of several variables is checked at as many points: all at
their first value, all at their second, all at their third.
"""

from __future__ import annotations

import tvm
from tvm import relax, sym, tirx

from tvm_stitch.analysis import closed_form
from tvm_stitch.analysis.size_bounds import sizes

ODD = 37
UNBOUNDED_LARGE = 128


def shape_vars(func: tirx.PrimFunc) -> list:
    """Names of the symbolic variables of `func`'s parameter shapes and scalar parameters, in order."""
    return list(sizes(func))


def recorded_bounds(mod: tvm.IRModule) -> tuple:
    """({name: lower bound}, {name: upper bound}) from the Relax functions of `mod`."""
    lower, upper = {}, {}
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            low, high = closed_form.recorded_bounds(func)
            lower.update(low)
            upper.update(high)
    return lower, upper


def default_values(low: int | None, high: int | None) -> tuple:
    """(lower bound, an odd value within the bounds, upper bound), without repeats."""
    low = max(1, low if low is not None else 1)
    high = high if high is not None else max(UNBOUNDED_LARGE, low)
    if high < low:
        raise ValueError(f"upper bound {high} is below lower bound {low}")
    odd = min(max(ODD, low), high)
    if odd % 2 == 0:
        odd = odd + 1 if odd < high else odd - 1
    return tuple(dict.fromkeys(v for v in (low, odd, high) if low <= v <= high))


def size_points(func: tirx.PrimFunc, lower: dict, upper: dict, given: dict) -> list:
    """The {variable name: value} points `func` is checked at ([{}] for a static kernel).

    `given`: name -> the values to check (the caller's), else the bounds' defaults.
    """
    names = shape_vars(func)
    values = {n: tuple(int(v) for v in given[n]) if n in given else default_values(lower.get(n), upper.get(n))
              for n in names}
    if any(not v for v in values.values()):
        raise ValueError(f"no values given for {[n for n, v in values.items() if not v]}")
    count = max((len(v) for v in values.values()), default=1)
    points = [{n: v[min(i, len(v) - 1)] for n, v in values.items()} for i in range(count)]
    return [p for i, p in enumerate(points) if p not in points[:i]]


def concrete(expr, values: dict) -> int:
    """The integer value of `expr` with its variables at `values` (name -> int)."""
    if isinstance(expr, int):
        return expr
    analyzer = sym.Analyzer()
    for var in tvm.tirx.analysis.undefined_vars(expr, []):
        if str(var.name) not in values:
            raise ValueError(f"{expr}: no value for the symbolic variable {var.name}")
        analyzer.bind(var, tirx.IntImm(var.ty.dtype, values[str(var.name)]))
    value = analyzer.simplify(expr)
    if not isinstance(value, tirx.IntImm):
        raise ValueError(f"{expr} is not an integer at {values}: {value}")
    return int(value.value)


def describe(point: dict) -> str:
    """`n=37, s=5` (empty for a static kernel)."""
    return ", ".join(f"{k}={v}" for k, v in point.items())
