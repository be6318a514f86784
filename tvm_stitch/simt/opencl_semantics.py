"""Rewrites that keep a kernel's CUDA meaning when TVM's OpenCL code generator would change it.

OpenCL C's vector comparisons give -1 (all bits set) for true where scalar
ones, and CUDA's (which TVM emits element by element), give 1. TVM's OpenCL
code generator casts a vectorised comparison with `convert_int4(a < b)`, so
`where(a < b, x, y)`, lowered through `0 < int(a < b)`, picks the wrong side
once vectorised. Before lowering, every cast of a boolean becomes a select
between one and zero, which OpenCL's `select` evaluates by the sign bit: the
value the CUDA kernel computes.

TVM lowers the math intrinsics OpenCL has no rule for (atanh, acosh, asinh,
...) to C's libm names, float-suffixed (`atanhf`), which OpenCL C does not
declare; its overloaded built-ins of the same names compute them. The
source gets those names (`libm_names_as_builtins`). A vectorised `tan` has
no OpenCL lowering at all (`Unresolved call`): it is written as
`sin / cos` before lowering (`tan_as_sin_over_cos`), a few ulps apart.

CUDA's atomic add (`tirx.cuda.atomic_add`, a scatter-add's accumulation)
has no OpenCL lowering either; TVM's OpenCL code generator writes an
external call `atomic_add` on a float32 address as a compare-and-swap loop
(`atomic_add_float_emu`), which adds as atomically (`cuda_atomics_as_opencl`)
once its first read of the old value is an atomic one as well (a plain read
beside other work-items' compare-and-swaps is a data race in OpenCL's memory
model, which Oclgrind reports: `emulated_atomics_read_atomically`).
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx


def bool_casts_as_selects(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def cast(e):
        if not isinstance(e, tirx.Cast) or not str(e.value.ty).startswith("bool"):
            return e
        dtype = str(e.ty)
        return tirx.Select(e.value, tirx.const(1, dtype), tirx.const(0, dtype))

    return tvm_ffi.structural_map(func, [(tvm.ir.Expr, cast)], order="post")


# OpenCL C built-ins (OpenCL 1.2, 6.12.2) that C's libm also has under a float-suffixed name.
OPENCL_MATH = ("acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "copysign", "cos",
               "cosh", "erf", "erfc", "exp", "exp2", "exp10", "expm1", "fabs", "floor", "fma", "fmod", "hypot",
               "ldexp", "lgamma", "log", "log10", "log1p", "log2", "nextafter", "pow", "round", "sin", "sinh",
               "sqrt", "tan", "tanh", "tgamma", "trunc")
_LIBM_FLOAT = re.compile(r"\b(" + "|".join(OPENCL_MATH) + r")f\(")


def libm_names_as_builtins(source: str) -> str:
    """`source` with every call of a float-suffixed libm function (`atanhf(`) named as OpenCL's
    overloaded built-in (`atanh(`), which takes and returns float for a float argument."""
    return _LIBM_FLOAT.sub(lambda m: m.group(1) + "(", source)


def tan_as_sin_over_cos(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def tan(e):
        if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "tirx.tan":
            return tirx.sin(e.args[0]) / tirx.cos(e.args[0])
        return e

    return tvm_ffi.structural_map(func, [(tvm.ir.Expr, tan)], order="post")


def cuda_atomics_as_opencl(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def atomic(e):
        if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "tirx.cuda.atomic_add":
            return tirx.call_extern(e.ty, "atomic_add", *e.args)
        return e

    return tvm_ffi.structural_map(func, [(tvm.ir.Expr, atomic)], order="post")


_EMULATED_READ = "prev_value =*(sum);"


def emulated_atomics_read_atomically(source: str) -> str:
    """`source` with the old value of TVM's emulated float atomic add read by an atomic (`atomic_or` with 0
    returns the value and leaves it)."""
    return source.replace(_EMULATED_READ, "prev_value = as_float(atomic_or((volatile __global int *)(sum), 0));")
