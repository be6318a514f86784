"""Selects inside vectorised loops become `if_then_else`, which TVM's CUDA code generator handles.

TVM 0.27's VectorizeLoop turns a `Select` in a vectorised loop into a
vector select with a broadcast condition, and its CUDA code generator
then declares that condition with the select's own type: a float
select's lane-invariant condition comes out as
`float2 v = make_ushort2(...)`, which nvcc rejects; a vector condition
that is itself a select's comparison can stop the build in TVM's
IntSetAnalyzer instead. dlight's Matmul rule vectorises the
global-to-shared load that a folded prologue reads through (a
`slice_scatter`'s select in LLaMA's backward rotary embedding) and the
write-back its epilogue joins, so a select reaches such a loop there.

`if_then_else(c, a, b)` computes the same value (it evaluates only the
branch taken, where `Select` evaluates both): with a lane-invariant
condition VectorizeLoop keeps one scalar condition for the vector
branches, and with a condition that varies per lane it serialises that
loop, which the code generator handles too.
"""

from __future__ import annotations

import tvm_ffi
from tvm import tirx


def _as_branch(select: tirx.Select):
    return tirx.if_then_else(select.condition, select.true_value, select.false_value)


def _loop(loop: tirx.For):
    if loop.kind != tirx.ForKind.VECTORIZED:
        return loop
    body = tvm_ffi.structural_map(loop.body, (tirx.Select, _as_branch))
    if body.same_as(loop.body):
        return loop
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations,
                    loop.step)


def selects_as_branches(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every `Select` under a vectorised loop written as `if_then_else` (same values)."""
    return tvm_ffi.structural_map(func, (tirx.For, _loop))
