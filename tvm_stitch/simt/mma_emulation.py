"""Tensor-core instructions (ldmatrix, mma.sync) emulated lane by lane for the OpenCL build.

TVM's tensor intrinsics for CUDA (tvm.s_tir.tensor_intrin.cuda) put
`ptx_legacy.ldmatrix`, `ptx_legacy.mma`, `mma_fill_legacy` and
`mma_store_legacy` calls into a scheduled PrimFunc; OpenCL has none of them.
`lane_calls` replaces each (before float16/bfloat16 widening) by a call of an
OpenCL function this module writes (`helpers`), and `with_exchange` gives
each kernel the local memory those functions exchange through.

Every work-item is one lane of a warp (32 consecutive work-items of the
work-group). A lane holds only its own fragment elements, in its private
array, where PTX's documented layouts put them (simt/ptx_fragments.py);
what the hardware moves between lanes goes through __local memory between
two barriers:
- ldmatrix .m8n8 .x1/.x2/.x4 (.trans) .b16: each lane that gives a row
  address copies its row (8 elements) into the exchange; after the barrier
  each lane takes, per matrix, its two elements (of the transposed matrix
  with .trans);
- mma.sync .m16n8k16 .row.col, .f16/.bf16 multiplicands, .f32/.f16
  accumulators: each lane writes its a0..a7 and b0..b3 to their places in A
  and B; after the barrier each lane computes its own d0..d3 (its c<i> plus
  the row of A times the column of B, in float32; rounded to float16 for an
  .f16 accumulator);
- ldmatrix .x1/.x2/.x4 .b16 of a float32 tile (the TF32 GEMMs'): each
  row is 4 32-bit elements, and each lane takes one per matrix (no .trans);
- mma.sync .m16n8k8 .row.col, .tf32 multiplicands, .f32 accumulators: as
  m16n8k16 with A 16 x 8 (a0..a3) and B 8 x 8 (b0, b1), each multiplicand
  truncated to TF32 (its low 13 mantissa bits dropped, as the tensor cores
  read a float32 register);
- `tvm_warp_shuffle_xor` (float32; CUDA's `__shfl_xor_sync`, the fold of a
  row over the lanes holding it): each lane writes its value, after the
  barrier takes that of lane `lane ^ lane_mask` (its own where that lane is
  outside its `width`-lane segment);
- mma_fill and mma_store touch only the lane's own elements, no exchange:
  zero, and the 16 x 16 positions TVM's CUDA code generator gives a lane's
  eight elements in `mma_store` (`_tvm_store_position`: code TVM writes,
  not a PTX instruction, so not taken from ptx_fragments).
A fragment layout that differs from PTX's puts values where the kernel's
other code (the store, an epilogue) does not look for them: the check fails.
The barriers require every lane of the work-group to reach each call, as
mma.sync requires of a warp's lanes.
"""

from __future__ import annotations

import math
import re
from types import MappingProxyType

import tvm
import tvm_ffi
from tvm import tirx

from tvm_stitch.simt import ptx_fragments
from tvm_stitch.simt.narrow_floats import ROUND

PREFIX = "tvm_stitch_"
EXCHANGE = PREFIX + "mma_exchange"
# Per warp: A (16 x 16) and B (16 x 8) of an mma; ldmatrix .x4 uses the first 4 x 8 x 8.
EXCHANGE_PER_WARP = ptx_fragments.MMA_M * ptx_fragments.MMA_K + ptx_fragments.MMA_K * ptx_fragments.MMA_N
STORE_TILE = 16  # mma_store_legacy / mma_fill_legacy act on a 16 x 16 tile: 8 elements per lane
_MULTIPLICANDS = ("fp16", "bf16")
TF32_SHAPE = ("m16n8k8", "row", "col", "tf32", "tf32", "fp32")
_ACCUMULATORS = MappingProxyType({"fp32": "mma_f32", "fp16": "mma_f16"})


class MmaNotEmulated(ValueError):
    """A tensor-core call this emulation does not cover (reported as unsupported)."""


def _op_name(e) -> str:
    return str(e.op.name) if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) else ""


def _text(arg) -> str:
    return str(arg.value) if type(arg).__name__ == "StringImm" else ""


def _element_dtype(pointer) -> str:
    """The element dtype of a fragment's data pointer ("" where it does not say)."""
    element = getattr(getattr(pointer, "ty", None), "element_type", None)
    return str(getattr(element, "dtype", ""))


def _ldmatrix(args, dtype: str) -> tirx.PrimExpr:
    trans, num, kind, frag, frag_off, smem, smem_off = args
    if _text(kind) != ".b16" or int(num.value) not in (1, 2, 4):
        raise MmaNotEmulated(f"ldmatrix {_text(kind)} .x{num} is not emulated (.b16 .x1/.x2/.x4 are)")
    if dtype == "float32":
        if bool(trans.value):
            raise MmaNotEmulated("ldmatrix .trans of a 32-bit tile is not emulated (it moves 16-bit halves)")
        return tirx.call_extern("void", PREFIX + "ldmatrix32", num, frag, frag_off, smem, smem_off)
    return tirx.call_extern("void", PREFIX + "ldmatrix", tirx.IntImm("int32", int(bool(trans.value))), num,
                            frag, frag_off, smem, smem_off)


def _mma(args) -> tirx.PrimExpr:
    if len(args) != 13:
        raise MmaNotEmulated(f"mma with {len(args)} arguments is not emulated (sparse or bit operations)")
    shape, a_layout, b_layout, a_type, b_type, c_type = (_text(a) for a in args[:6])
    if (shape, a_layout, b_layout, a_type, b_type, c_type) == TF32_SHAPE:
        return tirx.call_extern("void", PREFIX + "mma_tf32", *args[6:12])
    if (shape, a_layout, b_layout) != ("m16n8k16", "row", "col") or a_type != b_type \
            or a_type not in _MULTIPLICANDS or c_type not in _ACCUMULATORS:
        raise MmaNotEmulated(f"mma {shape}.{a_layout}.{b_layout} {a_type} x {b_type} -> {c_type} is not emulated "
                             "(m16n8k16.row.col, fp16/bf16 -> fp32/fp16, and m16n8k8.row.col tf32 -> fp32 are)")
    return tirx.call_extern("void", PREFIX + _ACCUMULATORS[c_type], *args[6:12])


def _shuffle_xor(e) -> tirx.PrimExpr:
    _mask, value, lane_mask, width, _warp_size = e.args
    if str(value.ty.dtype) != "float32":
        raise MmaNotEmulated(f"a warp shuffle of {value.ty.dtype} is not emulated (float32 is)")
    return tirx.call_extern("float32", PREFIX + "shfl_xor", value, lane_mask, width)


def _lane_tile(loop):
    """A `threadIdx.x` loop over one mma_fill / mma_store call, the call made lane-explicit."""
    body = loop.body
    if loop.thread_binding is None or str(loop.thread_binding.thread_tag) != "threadIdx.x" \
            or not isinstance(body, tirx.Evaluate):
        return loop
    name, args = _op_name(body.value), body.value.args
    lane_base = loop.loop_var * (STORE_TILE * STORE_TILE // ptx_fragments.WARP)
    if name == "tirx.mma_fill_legacy":
        call = tirx.call_extern("void", PREFIX + "mma_fill", args[0], args[1], args[2] + lane_base)
    elif name == "tirx.mma_store_legacy":
        if int(args[0].value) != STORE_TILE or int(args[1].value) != STORE_TILE:
            raise MmaNotEmulated(f"mma_store of {args[0]} x {args[1]} is not emulated (16 x 16 is)")
        call = tirx.call_extern("void", PREFIX + "mma_store", args[2], args[3], args[4] + lane_base, args[5])
    else:
        return loop
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.Evaluate(call), loop.thread_binding,
                    loop.annotations)


def has_tensor_core_calls(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func, (tvm.ir.Expr, lambda e: found.append(e) if _op_name(e).startswith(
        ("tirx.ptx_legacy.", "tirx.mma_")) else None), order="pre")
    return bool(found)


def lane_calls(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its ldmatrix, mma, mma_fill, mma_store and xor-shuffle calls as calls of the emulating
    functions."""
    def expr(e):
        name = _op_name(e)
        if name == "tirx.tvm_warp_shuffle_xor":
            return _shuffle_xor(e)
        if name == "tirx.ptx_legacy.ldmatrix":
            return _ldmatrix(list(e.args), _element_dtype(e.args[3]))
        if name == "tirx.ptx_legacy.mma":
            return _mma(list(e.args))
        if name.startswith("tirx.ptx_legacy."):
            raise MmaNotEmulated(f"{name} is not emulated")
        return e

    out = tvm_ffi.structural_map(func, [(tvm.ir.Expr, expr), (tirx.For, _lane_tile)], order="post")
    if has_tensor_core_calls(out):
        raise MmaNotEmulated("an mma_fill/mma_store call outside a threadIdx.x loop of its own is not emulated")
    return out


def _table(name: str, cells: list) -> str:
    """A __constant table of (row, column) pairs."""
    body = ", ".join(f"{{{r}, {c}}}" for r, c in cells)
    return f"__constant uchar {PREFIX}{name}[{len(cells)}][2] = {{{body}}};"


def _tvm_store_position(lane: int, i: int) -> tuple:
    """(row, column) in the 16 x 16 tile where TVM's CUDA code for `mma_store` puts element i of `lane`."""
    return lane // 4 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


def _tables() -> str:
    f, warp = ptx_fragments, ptx_fragments.WARP
    return "\n".join([
        _table("ld_given", [f.ldmatrix_row_given(lane) for lane in range(warp)]),
        _table("ld_take", [f.ldmatrix_element(lane, j) for lane in range(warp) for j in range(2)]),
        _table("mma_a_at", [f.mma_a(lane, i) for lane in range(warp) for i in range(8)]),
        _table("mma_b_at", [f.mma_b(lane, i) for lane in range(warp) for i in range(4)]),
        _table("mma_c_at", [f.mma_c(lane, i) for lane in range(warp) for i in range(4)]),
        _table("ld32_take", [f.ldmatrix_element_32(lane) for lane in range(warp)]),
        _table("tf32_a_at", [f.mma_tf32_a(lane, i) for lane in range(warp) for i in range(4)]),
        _table("tf32_b_at", [f.mma_tf32_b(lane, i) for lane in range(warp) for i in range(2)]),
        _table("store_at", [_tvm_store_position(lane, i) for lane in range(warp) for i in range(8)]),
    ])


def _mma_function(name: str, result: str) -> str:
    f = ptx_fragments
    return f"""
void {PREFIX}{name}_(__local float* xchg, __private float* a, int a_off, __private float* b, int b_off,
                     __private float* c, int c_off) {{
  int lane = {PREFIX}lane(); __local float* xa = xchg + {PREFIX}warp() * {EXCHANGE_PER_WARP};
  __local float* xb = xa + {f.MMA_M * f.MMA_K};
  for (int i = 0; i < 8; ++i) xa[{PREFIX}mma_a_at[lane * 8 + i][0] * {f.MMA_K} + {PREFIX}mma_a_at[lane * 8 + i][1]] = a[a_off + i];
  for (int i = 0; i < 4; ++i) xb[{PREFIX}mma_b_at[lane * 4 + i][0] * {f.MMA_N} + {PREFIX}mma_b_at[lane * 4 + i][1]] = b[b_off + i];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int i = 0; i < 4; ++i) {{
    int row = {PREFIX}mma_c_at[lane * 4 + i][0], col = {PREFIX}mma_c_at[lane * 4 + i][1];
    float acc = c[c_off + i];
    for (int k = 0; k < {f.MMA_K}; ++k) acc += xa[row * {f.MMA_K} + k] * xb[k * {f.MMA_N} + col];
    c[c_off + i] = {result};
  }}
  barrier(CLK_LOCAL_MEM_FENCE);
}}
#define {PREFIX}{name}(...) {PREFIX}{name}_({EXCHANGE}, __VA_ARGS__)
"""


def _ldmatrix32_function() -> str:
    rows, columns = ptx_fragments.LDMATRIX_ROWS, ptx_fragments.LDMATRIX_COLUMNS_32
    return f"""
void {PREFIX}ldmatrix32_(__local float* xchg, int num, __private float* frag, int frag_off,
                         __local float* smem, int smem_off) {{
  int lane = {PREFIX}lane(); __local float* x = xchg + {PREFIX}warp() * {EXCHANGE_PER_WARP};
  if (lane < num * {rows}) for (int c = 0; c < {columns}; ++c) x[lane * {columns} + c] = smem[smem_off + c];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int m = 0; m < num; ++m)
    frag[frag_off + m] = x[(m * {rows} + {PREFIX}ld32_take[lane][0]) * {columns} + {PREFIX}ld32_take[lane][1]];
  barrier(CLK_LOCAL_MEM_FENCE);
}}
#define {PREFIX}ldmatrix32(...) {PREFIX}ldmatrix32_({EXCHANGE}, __VA_ARGS__)
"""


def _mma_tf32_function() -> str:
    f = ptx_fragments
    k, n = f.TF32_K, f.MMA_N
    return f"""
float {PREFIX}tf32(float v) {{ return as_float(as_uint(v) & 0xffffe000u); }}
void {PREFIX}mma_tf32_(__local float* xchg, __private float* a, int a_off, __private float* b, int b_off,
                       __private float* c, int c_off) {{
  int lane = {PREFIX}lane(); __local float* xa = xchg + {PREFIX}warp() * {EXCHANGE_PER_WARP};
  __local float* xb = xa + {f.MMA_M * k};
  for (int i = 0; i < 4; ++i) xa[{PREFIX}tf32_a_at[lane * 4 + i][0] * {k} + {PREFIX}tf32_a_at[lane * 4 + i][1]] = {PREFIX}tf32(a[a_off + i]);
  for (int i = 0; i < 2; ++i) xb[{PREFIX}tf32_b_at[lane * 2 + i][0] * {n} + {PREFIX}tf32_b_at[lane * 2 + i][1]] = {PREFIX}tf32(b[b_off + i]);
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int i = 0; i < 4; ++i) {{
    int row = {PREFIX}mma_c_at[lane * 4 + i][0], col = {PREFIX}mma_c_at[lane * 4 + i][1];
    float acc = c[c_off + i];
    for (int j = 0; j < {k}; ++j) acc += xa[row * {k} + j] * xb[j * {n} + col];
    c[c_off + i] = acc;
  }}
  barrier(CLK_LOCAL_MEM_FENCE);
}}
#define {PREFIX}mma_tf32(...) {PREFIX}mma_tf32_({EXCHANGE}, __VA_ARGS__)
"""


def _store_function(space: str) -> str:
    return f"""
void __attribute__((overloadable)) {PREFIX}mma_store({space} float* dst, __private float* frag, int off, int stride) {{
  int lane = {PREFIX}lane();
  for (int i = 0; i < 8; ++i) dst[{PREFIX}store_at[lane * 8 + i][0] * stride + {PREFIX}store_at[lane * 8 + i][1]] = frag[off + i];
}}"""


def helpers() -> str:
    """The OpenCL C of the emulating functions (float storage: run after narrow_floats' widening)."""
    rows = ptx_fragments.LDMATRIX_ROWS
    return _tables() + f"""
int {PREFIX}thread() {{
  return (int)(get_local_id(0) + get_local_size(0) * (get_local_id(1) + get_local_size(1) * get_local_id(2)));
}}
int {PREFIX}lane() {{ return {PREFIX}thread() % {ptx_fragments.WARP}; }}
int {PREFIX}warp() {{ return {PREFIX}thread() / {ptx_fragments.WARP}; }}
void {PREFIX}ldmatrix_(__local float* xchg, int trans, int num, __private float* frag, int frag_off,
                       __local float* smem, int smem_off) {{
  int lane = {PREFIX}lane(); __local float* x = xchg + {PREFIX}warp() * {EXCHANGE_PER_WARP};
  if (lane < num * {rows}) {{
    int at = ({PREFIX}ld_given[lane][0] * {rows} + {PREFIX}ld_given[lane][1]) * {rows};
    for (int c = 0; c < {rows}; ++c) x[at + c] = smem[smem_off + c];
  }}
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int m = 0; m < num; ++m) for (int j = 0; j < 2; ++j) {{
    int row = {PREFIX}ld_take[lane * 2 + j][0], col = {PREFIX}ld_take[lane * 2 + j][1];
    frag[frag_off + 2 * m + j] = trans ? x[(m * {rows} + col) * {rows} + row] : x[(m * {rows} + row) * {rows} + col];
  }}
  barrier(CLK_LOCAL_MEM_FENCE);
}}
#define {PREFIX}ldmatrix(...) {PREFIX}ldmatrix_({EXCHANGE}, __VA_ARGS__)
float {PREFIX}shfl_xor_(__local float* xchg, float value, int lane_mask, int width) {{
  int lane = {PREFIX}lane(), src = lane ^ lane_mask; __local float* x = xchg + {PREFIX}warp() * {EXCHANGE_PER_WARP};
  if (src / width != lane / width) src = lane;
  x[lane] = value;
  barrier(CLK_LOCAL_MEM_FENCE);
  float got = x[src];
  barrier(CLK_LOCAL_MEM_FENCE);
  return got;
}}
#define {PREFIX}shfl_xor(...) {PREFIX}shfl_xor_({EXCHANGE}, __VA_ARGS__)
void {PREFIX}mma_fill(int n, __private float* frag, int off) {{ for (int i = 0; i < n; ++i) frag[off + i] = 0.0f; }}
""" + _mma_function("mma_f32", "acc") + _mma_function("mma_f16", f"{ROUND['float16']}(acc)") \
        + _ldmatrix32_function() + _mma_tf32_function() \
        + _store_function("__global") + _store_function("__local") + "\n"


_KERNEL = re.compile(r"(__kernel\s+void\s+\w+\s*\([^)]*\)\s*\{)")


def with_exchange(source: str, plan) -> str:
    """`source` with the emulating functions and, in every kernel, the __local exchange sized for the
    largest work-group of `plan`; unchanged where it calls none of them."""
    if not re.search(PREFIX + r"(ldmatrix|mma_|shfl_)\w*\(", source):
        return source
    warps = max(math.ceil(math.prod(int(b) for b in launch.block) / ptx_fragments.WARP) for launch in plan.launches)
    declaration = f"\n  __local float {EXCHANGE}[{warps * EXCHANGE_PER_WARP}];"
    return helpers() + _KERNEL.sub(lambda m: m.group(1) + declaration, source)
