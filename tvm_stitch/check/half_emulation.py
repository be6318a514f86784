"""float16 kernels on OpenCL devices without `cl_khr_fp16` (pocl 3 on x86, Oclgrind 21).

Such devices accept `half` only behind pointers, through vload_half and
vstore_half. The kernel is rewritten in TIR, before lowering, into the same
computation with every float16 buffer, variable and constant stored as a
float32 that holds a float16 value: each operation whose result was
float16 (arithmetic, math calls, casts to float16) is computed in float32
and rounded to float16 at once (`ROUND_HALF`, IEEE round-to-nearest-even
through vstore_half_rte). For +, -, *, / and sqrt that is exactly float16
arithmetic (float32 carries more than twice float16's precision, so the
double rounding is harmless); max, min, selects, loads and stores need no
rounding; a float16 reduction accumulates in float32, rounded when
its result is stored (TVM lowers only reducers it recognises). Element positions, vector widths, barriers and thread mappings
are unchanged, so races and bounds are checked as they are; only byte
offsets double. The host passes float16 data widened to float32 and
narrows the outputs back, both exactly.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

ROUND_HALF = "tvm_stitch_round_half"

_WIDTHS = ("", "2", "3", "4", "8", "16")
HELPERS = "\n".join(
    f"float{w} __attribute__((overloadable)) {ROUND_HALF}(float{w} x) {{ ushort{w} h; "
    f"vstore_half{w}_rte(x, 0, (__private half*)&h); return vload_half{w}(0, (__private half*)&h); }}"
    for w in _WIDTHS
) + "\n"

_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod)
_EXACT = (tirx.Min, tirx.Max)
_NO_ROUNDING_CALLS = ("tirx.if_then_else",)
_HALF_MAX = float(np.finfo(np.float16).max)


class HalfNotEmulated(ValueError):
    """A float16 construct this rewrite does not cover (reported as unsupported)."""


def uses_half(func: tirx.PrimFunc) -> bool:
    """Whether any buffer, variable or expression of `func` is float16."""
    found = []

    def visit(node):
        ty = node.ty
        if (isinstance(ty, tirx.BufferType) and str(ty.dtype) == "float16") or _is_half(node):
            found.append(node)

    tvm_ffi.structural_walk(func, ((tvm.ir.Var, tvm.ir.Expr), visit), order="pre")
    return bool(found)


def _is_half(expr) -> bool:
    return not isinstance(expr.ty, tirx.BufferType) and str(expr.ty).startswith("float16")


def _widened(dtype) -> str:
    return str(dtype).replace("float16", "float32")


def _is_round(expr) -> bool:
    return (type(expr).__name__ == "Call" and str(expr.op.name) == "tirx.call_pure_extern"
            and str(getattr(expr.args[0], "value", "")) == ROUND_HALF)


def _round(expr):
    return tirx.call_pure_extern(str(expr.ty), ROUND_HALF, expr)


def widen_half(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with float16 storage widened to float32 and float16 arithmetic rounded (module docstring)."""
    replaced = []  # (old Var, new Var): every occurrence of a variable gets the same new one

    def var(v):
        for old, new in replaced:
            if v.same_as(old):
                return new
        ty = v.ty
        if isinstance(ty, tirx.BufferType) and str(ty.dtype) == "float16":
            new = tirx.decl_buffer(ty.shape, "float32", str(v.name), strides=ty.strides or None,
                                   elem_offset=ty.elem_offset, scope=str(ty.storage_scope),
                                   data_alignment=ty.data_alignment, offset_factor=ty.offset_factor,
                                   layout=ty.layout)
        elif _is_half(v):
            new = tirx.Var(str(v.name), _widened(v.ty))
        else:
            return v
        replaced.append((v, new))
        return new

    def expr(e):
        if isinstance(e, tirx.Cast):
            if not _is_half(e):
                return e.value if str(e.value.ty) == str(e.ty) else tirx.Cast(str(e.ty), e.value)
            value = e.value if str(e.value.ty) == _widened(e.ty) else tirx.Cast(_widened(e.ty), e.value)
            return _round(value)
        if not _is_half(e):
            return e
        if isinstance(e, tirx.FloatImm):
            return tirx.FloatImm("float32", float(np.float16(e.value)))
        if isinstance(e, tvm.ir.TensorLoad):
            return tirx.BufferLoad(e.source, list(e.indices))
        if isinstance(e, _ARITHMETIC):
            return _round(type(e)(e.a, e.b))
        if isinstance(e, _EXACT):
            return type(e)(e.a, e.b)
        if isinstance(e, tirx.Select):
            return tirx.Select(e.condition, e.true_value, e.false_value)
        if isinstance(e, tirx.Broadcast):
            return tirx.Broadcast(e.value, e.lanes)
        if isinstance(e, tirx.Let):
            return tirx.Let(e.var, e.value, e.body)
        if type(e).__name__ == "Call":
            call = tirx.call_intrin(_widened(e.ty), e.op, *e.args)
            return call if str(e.op.name) in _NO_ROUNDING_CALLS else _round(call)
        raise HalfNotEmulated(f"float16 {type(e).__name__} is not emulated: {e}")

    def block(b):
        # TVM lowers a reduction only if it recognises its combiner (x + y, max, ...) and identity:
        # a float16 sum accumulates unrounded, and a max/min starts from float32's extreme value.
        init, body = b.init, b.body
        if init is None:
            return b
        if isinstance(body, tirx.BufferStore) and _is_round(body.value):
            body = tirx.BufferStore(body.buffer, body.value.args[1], list(body.indices))
        if (isinstance(init, tirx.BufferStore) and isinstance(init.value, tirx.FloatImm)
                and str(init.value.ty) == "float32" and abs(init.value.value) == _HALF_MAX):
            extreme = tirx.max_value("float32") if init.value.value > 0 else tirx.min_value("float32")
            init = tirx.BufferStore(init.buffer, extreme, list(init.indices))
        if init.same_as(b.init) and body.same_as(b.body):
            return b
        return s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, body, init, b.alloc_buffers,
                            b.match_buffers, b.annotations)

    widened = tvm_ffi.structural_map(func, [(tvm.ir.Var, var), (tvm.ir.Expr, expr), (s_tir.SBlock, block)],
                                     order="post")
    if uses_half(widened):
        raise HalfNotEmulated("float16 values remain after widening")
    return widened
