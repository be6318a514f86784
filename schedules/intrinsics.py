"""Intrinsics TVM's llvm lowering leaves to libm, rewritten into ones it lowers for vectors too.

TVM 0.27 lowers `tirx.cosh` and `tirx.sinh` on llvm by a call to libm's
`coshf` / `sinh` (`default.FLowerIntrinsic`), which it does for scalars
only: under a vectorised loop (every stitched CPU kernel, and the CUDA
schedules emulated on llvm) code generation fails with `unknown intrinsic`.
TVM's default pipeline never vectorises them, so its build works. Here
they become exponentials, which LLVM lowers at any width:

    cosh(x) = h + 1/(4h),                 h = exp(|x|) / 2 = (e / 2) e,  e = exp(|x| / 2)
    sinh(x) = sign(x) (h - 1/(4h))        for |x| >= 1
    sinh(x) = x (1 + x^2/3! + x^4/5! ...)  for |x| < 1 (no cancellation), to the dtype's precision

Halving the exponent keeps `cosh` and `sinh` finite up to the largest |x|
whose result is (89.4 in float32, where exp(x) overflows at 88.7), with
exact scalings only (measured against numpy in float64: tests/test_op_sweep.py). The series stops at the first term below a quarter of the dtype's
epsilon (float32: x^10/11!; float64: x^18/19!).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

EXPANDED = ("tirx.cosh", "tirx.sinh")


def _series_terms(dtype: str) -> list:
    """The coefficients 1/(2k+1)! of sinh(x)/x in x^2, while they matter at `dtype`'s precision."""
    eps = 2.0 ** -52 if dtype == "float64" else 2.0 ** -23
    terms, k = [], 0
    while True:
        coefficient = 1.0 / math.factorial(2 * k + 1)
        if coefficient < eps / 4:
            return terms
        terms.append(coefficient)
        k += 1


def _half_exp(x):
    """exp(|x|) / 2 as (e / 2) e with e = exp(|x| / 2): exact scalings (no rounded ln 2 in the
    exponent), and infinite only where the result is."""
    dtype = str(x.ty)
    e = tirx.exp(tirx.abs(x) * tirx.const(0.5, dtype))
    return e * tirx.const(0.5, dtype) * e


def _cosh(x):
    h = _half_exp(x)
    return h + tirx.const(0.25, str(x.ty)) / h


def _sinh(x):
    dtype = str(x.ty)
    h = _half_exp(x)
    large = h - tirx.const(0.25, dtype) / h
    square = x * x
    series = tirx.const(0.0, dtype)
    for coefficient in reversed(_series_terms(dtype)):
        series = series * square + tirx.const(coefficient, dtype)
    small = x * series
    signed = tirx.Select(x < tirx.const(0.0, dtype), -large, large)
    return tirx.Select(tirx.abs(x) < tirx.const(1.0, dtype), small, signed)


_RULES = {"tirx.cosh": _cosh, "tirx.sinh": _sinh}


def _expandable(node) -> bool:
    return (isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op) and node.op.name in _RULES
            and str(node.ty) in ("float32", "float64"))


def _rewrite(node, mutator):
    if not _expandable(node):
        return mutator.default_mutate(node)
    return _RULES[node.op.name](mutator.mutate(node.args[0]))


def expand_intrinsics(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every float32/float64 call of EXPANDED written as exponentials (itself if none)."""
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, lambda n: found.append(n) if _expandable(n) else None),
                            order="post")
    if not found:
        return func
    return func.with_body(tvm_ffi.structural_mutate(func.body, [(tvm.ir.Call, _rewrite)]))
