"""float16 and bfloat16 kernels on OpenCL devices that have neither type (pocl 3 on x86, Oclgrind 21).

OpenCL has no bfloat16, and without `cl_khr_fp16` it accepts `half` only
behind pointers. The kernel is rewritten in TIR, before lowering, into the
same computation with every float16/bfloat16 buffer, variable and constant
stored as a float32 that holds a value of that type: each operation whose
result was narrow (arithmetic, math calls, casts) is computed in float32 and
rounded to the narrow type at once (`ROUND`, IEEE round-to-nearest-even on
the float32 bits: 13 mantissa bits dropped for a normal float16, 16 for
bfloat16; a float16 subnormal as the nearest multiple of 2^-24 by `rint`, a
magnitude of 65520 or more as an infinity; no vload_half/vstore_half, whose
OpenCL C 2.0 forms take generic pointers that Oclgrind cannot run). For +, -,
*, / and sqrt that is exactly the narrow type's arithmetic (float32 carries
more than twice their precision, so the double rounding is harmless); max,
min, selects, loads and stores need no rounding; a narrow reduction
accumulates in float32 and is rounded when its result is stored (TVM
lowers only reducers it recognises). Element positions, vector widths,
barriers and thread mappings are unchanged, so races and bounds are checked
as they are; only byte offsets double. The host passes the narrow data
widened to float32 and narrows the outputs back, both exactly.
"""

from __future__ import annotations

from types import MappingProxyType

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

NARROW = ("bfloat16", "float16")  # bfloat16 first: "float16" is a suffix of it
ROUND = MappingProxyType({"float16": "tvm_stitch_round_float16", "bfloat16": "tvm_stitch_round_bfloat16"})
_LARGEST = MappingProxyType({"float16": float(np.finfo(np.float16).max),
                             "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)})
_SCALAR = MappingProxyType({"float16": np.float16, "bfloat16": ml_dtypes.bfloat16})

_WIDTHS = ("", "2", "3", "4", "8", "16")
HELPERS = "\n".join(
    f"float{w} __attribute__((overloadable)) {ROUND['float16']}(float{w} x) {{ uint{w} u = as_uint{w}(x); "
    f"float{w} normal = as_float{w}((u + (uint{w})0xFFF + ((u >> 13) & (uint{w})1)) & (uint{w})0xFFFFE000); "
    f"float{w} tiny = rint(x * 16777216.0f) * 5.9604644775390625e-08f; float{w} a = fabs(x); "
    f"float{w} r = select(select(normal, tiny, a < 6.103515625e-05f), copysign((float{w})INFINITY, x), "
    f"a >= 65520.0f); return select(r, x, isnan(x)); }}\n"
    f"float{w} __attribute__((overloadable)) {ROUND['bfloat16']}(float{w} x) {{ uint{w} u = as_uint{w}(x); "
    f"uint{w} r = (u + (uint{w})0x7FFF + ((u >> 16) & (uint{w})1)) & (uint{w})0xFFFF0000; "
    f"return select(as_float{w}(r), x, isnan(x)); }}"
    for w in _WIDTHS
) + "\n"

_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod)
_EXACT = (tirx.Min, tirx.Max)
_NO_ROUNDING_CALLS = ("tirx.if_then_else", "tirx.type_annotation")


class NarrowNotEmulated(ValueError):
    """A float16/bfloat16 construct this rewrite does not cover (reported as unsupported)."""


def _narrow(text: str):
    """The narrow float type a dtype string names ("float16x8" -> "float16"), or None."""
    return next((n for n in NARROW if str(text).startswith(n)), None)


def _narrow_of(node):
    ty = node.ty
    return _narrow(ty.dtype) if isinstance(ty, tirx.BufferType) else _narrow(str(ty))


def narrow_types(func: tirx.PrimFunc) -> set:
    """The narrow float types among the buffers, variables and expressions of `func`."""
    found = set()

    def visit(node):
        kind = _narrow_of(node)
        if kind is not None:
            found.add(kind)

    tvm_ffi.structural_walk(func, ((tvm.ir.Var, tvm.ir.Expr), visit), order="pre")
    return found


def _widened(dtype) -> str:
    text = str(dtype)
    kind = _narrow(text)
    return "float32" + text[len(kind):] if kind else text


def _is_round(expr) -> bool:
    return (type(expr).__name__ == "Call" and str(expr.op.name) == "tirx.call_pure_extern"
            and str(getattr(expr.args[0], "value", "")) in ROUND.values())


def _round(expr, kind: str):
    return tirx.call_pure_extern(str(expr.ty), ROUND[kind], expr)


def widen(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with float16/bfloat16 storage widened to float32 and their arithmetic rounded (see above)."""
    replaced = []  # (old Var, new Var): every occurrence of a variable gets the same new one

    def var(v):
        for old, new in replaced:
            if v.same_as(old):
                return new
        ty = v.ty
        if isinstance(ty, tirx.BufferType) and _narrow(ty.dtype):
            new = tirx.decl_buffer(ty.shape, "float32", str(v.name), strides=ty.strides or None,
                                   elem_offset=ty.elem_offset, scope=str(ty.storage_scope),
                                   data_alignment=ty.data_alignment, offset_factor=ty.offset_factor,
                                   layout=ty.layout)
        elif _narrow_of(v):
            new = tirx.Var(str(v.name), _widened(v.ty))
        else:
            return v
        replaced.append((v, new))
        return new

    def expr(e):
        kind = _narrow_of(e)
        if isinstance(e, tirx.Cast):
            if kind is None:
                return e.value if str(e.value.ty) == str(e.ty) else tirx.Cast(str(e.ty), e.value)
            value = e.value if str(e.value.ty) == _widened(e.ty) else tirx.Cast(_widened(e.ty), e.value)
            return _round(value, kind)
        if kind is None:
            return e
        if isinstance(e, tirx.FloatImm):
            return tirx.FloatImm("float32", float(_SCALAR[kind](e.value)))
        if isinstance(e, tvm.ir.TensorLoad):
            return tirx.BufferLoad(e.source, list(e.indices))
        if isinstance(e, _ARITHMETIC):
            return _round(type(e)(e.a, e.b), kind)
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
            return call if str(e.op.name) in _NO_ROUNDING_CALLS else _round(call, kind)
        raise NarrowNotEmulated(f"{kind} {type(e).__name__} is not emulated: {e}")

    def block(b):
        # TVM lowers a reduction only if it recognises its combiner (x + y, max, ...) and identity:
        # a narrow sum accumulates unrounded, and a max/min starts from float32's extreme value
        # (not the narrow type's, nor the infinity TVM's bfloat16 maximum rounds to).
        init, body = b.init, b.body
        if init is None:
            return b
        if isinstance(body, tirx.BufferStore) and _is_round(body.value):
            body = tirx.BufferStore(body.buffer, body.value.args[1], list(body.indices))
        if (isinstance(init, tirx.BufferStore) and isinstance(init.value, tirx.FloatImm)
                and str(init.value.ty) == "float32" and abs(init.value.value) >= min(_LARGEST.values())):
            extreme = tirx.max_value("float32") if init.value.value > 0 else tirx.min_value("float32")
            init = tirx.BufferStore(init.buffer, extreme, list(init.indices))
        if init.same_as(b.init) and body.same_as(b.body):
            return b
        return s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, body, init, b.alloc_buffers,
                            b.match_buffers, b.annotations)

    widened = tvm_ffi.structural_map(func, [(tvm.ir.Var, var), (tvm.ir.Expr, expr), (s_tir.SBlock, block)],
                                     order="post")
    if narrow_types(widened):
        raise NarrowNotEmulated("float16/bfloat16 values remain after widening")
    return widened
