"""Rewrites that keep a kernel's CUDA meaning when TVM's OpenCL code generator would change it.

OpenCL C's vector comparisons give -1 (all bits set) for true where scalar
ones, and CUDA's (which TVM emits element by element), give 1. TVM's OpenCL
code generator casts a vectorised comparison with `convert_int4(a < b)`, so
`where(a < b, x, y)`, lowered through `0 < int(a < b)`, picks the wrong side
once vectorised. Before lowering, every cast of a boolean becomes a select
between one and zero, which OpenCL's `select` evaluates by the sign bit: the
value the CUDA kernel computes.
"""

from __future__ import annotations

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
