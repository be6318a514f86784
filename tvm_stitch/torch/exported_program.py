"""The exported-program importer's converters replaced for the traps `from_torch` meets (ExportedProgram op
names): half-precision dtypes (dtype_converters.py), the gradient ops (gradient_ops.py), a bool cumsum (the
importer keeps it bool) and slices under symbolic sizes (the extents PyTorch proved, not min/max forms)."""

from __future__ import annotations

import sys

import tvm
import tvm_ffi
from tvm import relax, sym, tirx

from tvm_stitch.analysis.tir_view import vars_in
from tvm_stitch.torch.dtype_converters import dtype_converters
from tvm_stitch.torch.gradient_ops import converters as gradient_converters


def converters() -> dict:
    """The importer's converters replaced for the traps above (ExportedProgram op names)."""
    return {**dtype_converters(), **gradient_converters(), "cumsum.default": _cumsum, "slice.Tensor": _slice}


def _cumsum(node, importer) -> relax.Var:
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dtype = node.kwargs.get("dtype")
    dtype = importer._convert_data_type(str(dtype), importer.env) if dtype is not None else None
    if dtype is None and x.ty.dtype == "bool":
        dtype = "int64"  # PyTorch sums bools (and every integer type) as int64
    return importer.block_builder.emit(relax.op.cumsum(x, dim, dtype))


def _slice(node, importer) -> relax.Var:
    """A slice on a non-negative axis (TOPI's dynamic slice refuses negative ones), cast to the
    extents PyTorch proved where the importer's are min/max forms."""
    x = importer.env[node.args[0]]
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    start, end, step = (importer.env[a] if hasattr(a, "meta") else a for a in (start, end, step))
    length = x.ty.shape[dim] if isinstance(x.ty.shape, relax.ShapeExpr) else None
    start = 0 if start is None else start
    if (start == 0 and step == 1 and (end is None or (isinstance(end, int) and end >= sys.maxsize)
                                       or (length is not None and tvm.ir.is_prim_expr(end)
                                           and tvm_ffi.structural_equal(end, length)))):
        return x  # the whole axis
    dim = dim if dim >= 0 else len(x.ty.shape) + dim
    end = sys.maxsize if end is None else end
    val = node.meta.get("val")
    proved = None
    if val is not None and isinstance(x.ty.shape, relax.ShapeExpr) and len(val.shape) == len(x.ty.shape):
        proved = [_proved_extent(t, d) for t, d in zip(val.shape, x.ty.shape.values)]
        proved[dim] = _proved_extent(val.shape[dim], end)
    # In bounds where PyTorch's extent is end - start: TOPI's clamped extent (min/max/if_then_else
    # forms under symbolic shapes, which FuseOps cannot type) is then not needed. Integer bounds
    # must be non-negative (assume_inbound does not wrap negative ones): `x[:, 0:1]` of a
    # symbolic axis is then in bounds, not a min/max extent cast back to 1, which would cut the
    # slice from its readers.
    bounds = not isinstance(end, int) or (isinstance(start, int) and 0 <= start <= end)
    inbound = bool(step == 1 and proved is not None and proved[dim] is not None and bounds
                   and sym.Analyzer().can_prove_equal(proved[dim], end - start))
    out = importer.block_builder.emit(relax.op.strided_slice(x, [dim], [start], [end], [step],
                                                             assume_inbound=inbound))
    if proved is None or not isinstance(out.ty, relax.TensorType) or not isinstance(out.ty.shape, relax.ShapeExpr):
        return out
    shape = list(out.ty.shape.values)
    if all(p is None or tvm_ffi.structural_equal(p, d) for p, d in zip(proved, shape)):
        return out
    shape = [d if p is None else p for p, d in zip(proved, shape)]
    return importer.block_builder.match_cast(out, relax.TensorType(shape, out.ty.dtype))


def _proved_extent(torch_dim, expr):
    """PyTorch's extent of a dimension as TIR: a constant, or the symbolic variable of that name
    that the importer's expression (or the slice's end) uses; None where neither."""
    if isinstance(torch_dim, int):
        return tirx.IntImm("int64", torch_dim)
    if not tvm.ir.is_prim_expr(expr):
        return None
    name = str(torch_dim)
    return next((v for v in vars_in(expr) if v.name == name), None)
