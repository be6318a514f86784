"""Converters for ATen ops of aot_autograd's graphs that TVM 0.27's exported-program importer gets wrong.

`exported_program.converters()` (bool cumsum, slices under symbolic sizes) apply
as they are. One more trap is met in training graphs: the importer maps
all three outputs of `aten.native_layer_norm` to the normalised output,
while the forward saves its mean and rstd for the backward. Here the
normalised output stays TVM's layer_norm, and mean and rstd are their own
reductions (what no reader uses, dead-code elimination drops).

And transformers' KV cache starts each layer's keys and values as
`torch.tensor([])` and concatenates onto it: PyTorch's `cat` skips a
1-d tensor of size 0 (its legacy rule), the importer refuses the mixed
ranks; here such inputs are skipped as PyTorch skips them.

`pow(x, 3)` (GPT-2's tanh GELU) is multiplications, not a libm call per
element.

Under `dynamic=True` dynamo turns a Python float computed from sizes
(GPT-2's attention scale) into a 0-d float64 tensor input, which the graph
casts with `prims.convert_element_type` and divides with
`aten.true_divide`: the importer has neither; they are a cast and a
division here.
"""

from __future__ import annotations

from tvm import relax, tirx

from tvm_stitch.torch.exported_program import converters as frontend_converters
from tvm_stitch.torch.allocations import converters as allocation_converters
from tvm_stitch.torch.foreach import converters as foreach_converters
from tvm_stitch.torch.gradient_ops import converters as gradient_converters


def converters() -> dict:
    """The importer's converters replaced for aot_autograd's graphs (ExportedProgram op names)."""
    return {**frontend_converters(), **foreach_converters(), **gradient_converters(), **allocation_converters(),
            "native_layer_norm.default": _native_layer_norm,
            "cat.default": _cat, "convert_element_type.default": _convert_element_type,
            "true_divide.Tensor": _true_divide, "pow.Tensor_Scalar": _pow}


SMALL_POWERS = range(1, 5)  # x ** n as n - 1 multiplications for these n


def _pow(node, importer):
    """A float tensor to a small whole power as multiplications: GPT-2's tanh GELU cubes its input, and
    `pow` is a libm call per element on llvm (scalar, and the stitch planner keeps its result in memory
    as an expensive op), where three multiplications vectorise and inline like the rest of the GELU."""
    base, exponent = node.args[0], node.args[1]
    x = importer.env[base] if hasattr(base, "op") else None
    whole = isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and float(exponent).is_integer()
    if x is None or not whole or int(exponent) not in SMALL_POWERS or not str(x.ty.dtype).startswith("float"):
        return importer._pow(node)
    result = x
    for _ in range(int(exponent) - 1):
        result = importer.block_builder.emit(relax.op.multiply(result, x))
    return result


def _convert_element_type(node, importer):
    x = importer.env[node.args[0]]
    return importer.block_builder.emit(relax.op.astype(x, importer._convert_data_type(node.args[1])))


def _true_divide(node, importer):
    a, b = (importer.env[x] if hasattr(x, "op") else x for x in node.args[:2])
    dtype = next(x.ty.dtype for x in (a, b) if isinstance(x, relax.Expr))
    a, b = (x if isinstance(x, relax.Expr) else relax.const(x, dtype) for x in (a, b))
    return importer.block_builder.emit(relax.op.divide(a, b))


def _cat(node, importer):
    tensors = [importer.env[a] for a in node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    kept = [t for t in tensors if not _legacy_empty(t)] or tensors[:1]
    if len(kept) == 1:
        return kept[0]
    return importer.block_builder.emit(relax.op.concat(kept, axis=dim))


def _legacy_empty(tensor) -> bool:
    shape = tensor.ty.shape if isinstance(tensor.ty, relax.TensorType) else None
    return (isinstance(shape, relax.ShapeExpr) and len(shape.values) == 1
            and isinstance(shape.values[0], tirx.IntImm) and shape.values[0].value == 0)


def _native_layer_norm(node, importer) -> tuple:
    """(normalised output, mean, rstd), the last two keeping the reduced axes as size 1, as PyTorch's."""
    x = importer.env[node.args[0]]
    shape, weight, bias = node.args[1], *(importer.env.get(a) if a is not None else None for a in node.args[2:4])
    eps = node.args[4] if len(node.args) > 4 else 1e-5
    out = importer._layer_norm_impl(x, weight, bias, eps, shape)
    axes = list(range(len(x.ty.shape) - len(shape), len(x.ty.shape)))
    emit = importer.block_builder.emit
    mean = emit(relax.op.mean(x, axes, keepdims=True))
    centred = emit(relax.op.subtract(x, mean))
    variance = emit(relax.op.mean(relax.op.multiply(centred, centred), axes, keepdims=True))
    rstd = emit(relax.op.rsqrt(relax.op.add(variance, relax.const(eps, x.ty.dtype))))
    return out, mean, rstd
