"""Converters that keep a half-precision model's dtypes through TVM 0.27's torch importer.

The importer emits every matrix product and convolution with
`out_dtype="float32"` (float32 accumulation) and leaves the result float32:

- where the op has a bias (`addmm`, `linear`, a convolution's bias), the
  half bias meets the float32 product in `R.add` and the import fails
  ("Binary operators must have the same datatype");
- elsewhere the float32 result spreads: the next binary op promotes its
  half operand, and the rest of the graph computes in float32.

These converters keep the float32 accumulation, add a bias in float32 (as
cuBLAS's epilogue does: alpha * acc + beta * bias in the compute type, one
rounding), and cast the result to the dtype PyTorch gives the node
(`node.meta["val"].dtype`). A float32 model is unchanged: every cast is
skipped where the dtypes already agree.
"""

from __future__ import annotations

from tvm import relax

FLOAT32_PRODUCTS = ("mm.default", "bmm.default", "matmul.default")
BIASED_CONVOLUTIONS = {"convolution.default": "_convolution", "conv1d.default": "_conv1d",
                       "conv2d.default": "_conv2d", "conv3d.default": "_conv3d"}  # op -> the importer's converter


def dtype_converters() -> dict:
    """ExportedProgram op name -> converter(node, importer) for the float32 products above."""
    table = {name: _product for name in FLOAT32_PRODUCTS}
    table.update({name: _convolution for name in BIASED_CONVOLUTIONS})
    table.update({"addmm.default": _addmm, "baddbmm.default": _addmm, "linear.default": _linear})
    return table


def _torch_dtype(node, importer) -> str | None:
    """The dtype PyTorch gives the node's tensor result, in TVM's spelling (None if not a tensor)."""
    val = node.meta.get("val")
    dtype = getattr(val, "dtype", None)
    return None if dtype is None else importer._convert_data_type(str(dtype))


def _cast(importer, value: relax.Expr, dtype: str | None) -> relax.Expr:
    if dtype is None or str(value.ty.dtype) == dtype:
        return value
    return importer.block_builder.emit(relax.op.astype(value, dtype))


def _scaled(importer, value: relax.Expr, factor) -> relax.Expr:
    if factor == 1:
        return value
    return importer.block_builder.emit(relax.op.multiply(value, relax.const(factor, str(value.ty.dtype))))


def _with_bias(node, importer, product: relax.Expr, bias: relax.Expr | None, beta=1,
               bias_first: bool = False) -> relax.Expr:
    """product (float32) + beta * bias, in float32, cast to the node's dtype; the operands of the add
    in the importer's order (`bias_first` for addmm), so a float32 model imports as before."""
    if bias is not None and beta != 0:
        wide = _cast(importer, product, "float32")
        bias = _scaled(importer, _cast(importer, bias, "float32"), beta)
        product = importer.block_builder.emit(relax.op.add(bias, wide) if bias_first else relax.op.add(wide, bias))
    return _cast(importer, product, _torch_dtype(node, importer))


def _product(node, importer) -> relax.Expr:
    a, b = importer.retrieve_args(node)[:2]
    out = importer.block_builder.emit(relax.op.matmul(a, b, out_dtype="float32"))
    return _cast(importer, out, _torch_dtype(node, importer))


def _addmm(node, importer) -> relax.Expr:
    """addmm and baddbmm: beta * input + alpha * (batch1 @ batch2)."""
    bias, a, b = importer.retrieve_args(node)[:3]
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    if alpha == 0:
        return _with_bias(node, importer, relax.const(0.0, "float32"), bias, beta)
    out = _scaled(importer, importer.block_builder.emit(relax.op.matmul(a, b, out_dtype="float32")), alpha)
    return _with_bias(node, importer, out, bias, beta, bias_first=node.target.__name__ == "addmm.default")


def _linear(node, importer) -> relax.Expr:
    args = importer.retrieve_args(node)
    x, weight, bias = args[0], args[1], (args[2] if len(args) > 2 else None)
    out = importer.block_builder.emit(relax.op.linear(x, weight, None, "float32"))
    return _with_bias(node, importer, out, bias)


class _WithoutBias:
    """A convolution node as the importer reads it, its bias argument dropped."""

    def __init__(self, node):
        self.args = tuple(a if i != 2 else None for i, a in enumerate(node.args))
        self.kwargs, self.meta, self.target, self.name = node.kwargs, node.meta, node.target, node.name


def _convolution(node, importer) -> relax.Expr:
    args = importer.retrieve_args(node)
    bias = args[2] if len(args) > 2 else None
    out = getattr(importer, BIASED_CONVOLUTIONS[node.target.__name__])(_WithoutBias(node))
    if bias is not None:
        rank = len(out.ty.shape)
        axis = 1  # NC... layouts: the bias is per output channel
        bias = importer.block_builder.emit(relax.op.reshape(bias, [-1 if i == axis else 1 for i in range(rank)]))
    return _with_bias(node, importer, out, bias)
