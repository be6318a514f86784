"""Converters for the two gradient ops of aot_autograd's backward graphs that TVM 0.27's importer cannot take.

An embedding's gradient (`aten.embedding_dense_backward`, which the core
ATen decompositions turn into `index_put(zeros, [ids], grad, accumulate=True)`)
reaches the importer with a 2-d index tensor (batch x sequence), which its
`index_put` converter refuses, and TVM's `topi.index_put` adds into its
output from parallel iterations: two equal ids (a repeated token) would race.
Here an `index_put` whose indices are all tensors becomes `relax.scatter_nd`
over the flattened index tuples, whose CPU kernel walks the indices in order
and parallelises within a row: repeated ids accumulate exactly, as PyTorch's.
An accumulating `index_put` under a full slice (`x[:, ids] += v`) would
reach TVM's racing kernel: it runs on eager.

`aten.convolution_backward` (2-d, not transposed) has no converter at all.
Its three outputs are a transposed convolution (the input's gradient), a
convolution with the roles of stride and dilation swapped whose "batch" is
the input's channels within a group and whose "kernel" is the output's
gradient (the weight's gradient), and a sum over batch and space (the bias's).
"""

from __future__ import annotations

from tvm import relax, tirx

from tvm_stitch.torch.errors import UnsupportedGraph
from tvm_stitch.torch.nodes import module_path, op_name


def converters() -> dict:
    return {"index_put.default": _index_put, "index_put_.default": _index_put,
            "convolution_backward.default": _convolution_backward}


def _static(expr, what: str, node, dims: int | None = None) -> list:
    """The static sizes of `expr` (its first `dims`); UnsupportedGraph where one is symbolic."""
    sizes = list(expr.ty.shape.values)[:dims] if isinstance(expr.ty.shape, relax.ShapeExpr) else None
    if sizes is None or not all(isinstance(s, tirx.IntImm) for s in sizes):
        raise UnsupportedGraph(f"{op_name(node)} needs static sizes of its {what}", op_name(node), module_path(node))
    return [int(s.value) for s in sizes]


def _index_put(node, importer):
    """`data[indices] (+)= values` as scatter_nd. Indices with a bool mask, or a None (a full slice) without
    accumulation, go to the importer's own converter; accumulation under a None runs on eager."""
    env, emit = importer.env, importer.block_builder.emit
    args = list(node.args) + [None] * (4 - len(node.args))
    accumulate = args[3] if args[3] is not None else node.kwargs.get("accumulate", False)
    data, values = env[args[0]], env[args[2]]
    indices = [env[i] if i is not None else None for i in args[1]]
    if accumulate and any(i is None for i in indices):
        raise UnsupportedGraph("index_put accumulating under a full slice: TVM's index_put adds from parallel "
                               "iterations, which repeated indices would race", op_name(node), module_path(node))
    if any(i is None or str(i.ty.dtype) == "bool" for i in indices):
        return importer._index_put(node)
    sizes = _static(data, "indexed axes", node, len(indices))
    indices = [emit(relax.op.astype(index, "int64")) for index in indices]
    zero = None
    for index in indices:
        term = emit(relax.op.multiply(index, relax.const(0, "int64")))
        zero = term if zero is None else emit(relax.op.add(zero, term))
    columns = []
    for index, size in zip(indices, sizes):
        index = emit(relax.op.add(index, zero))  # broadcast to the common shape
        index = emit(relax.op.where(relax.op.less(index, relax.const(0, "int64")),
                                    relax.op.add(index, relax.const(size, "int64")), index))
        columns.append(emit(relax.op.expand_dims(index, -1)))
    stacked = columns[0] if len(columns) == 1 else emit(relax.op.concat(columns, axis=-1))
    shape = list(stacked.ty.shape.values)[:-1] + list(data.ty.shape.values)[len(indices):]
    values = emit(relax.op.broadcast_to(values, relax.ShapeExpr(shape)))
    return emit(relax.op.scatter_nd(data, stacked, values, "add" if accumulate else "update"))


def _convolution_backward(node, importer) -> tuple:
    """(input's gradient, weight's gradient, bias's gradient), None where output_mask says it is not needed."""

    env, emit = importer.env, importer.block_builder.emit
    grad, x, weight = (env[a] for a in node.args[:3])
    _, stride, padding, dilation, transposed, _, groups, mask = node.args[3:11]
    if transposed or len(stride) != 2:
        kind = "a transposed convolution" if transposed else f"a {len(stride)}-d convolution"
        raise UnsupportedGraph(f"convolution_backward of {kind}", op_name(node), module_path(node))
    x_sizes, w_sizes, g_sizes = (_static(e, what, node) for e, what in ((x, "input"), (weight, "weight"),
                                                                        (grad, "output's gradient")))
    return (_input_gradient(emit, grad, weight, x_sizes, w_sizes, g_sizes, stride, padding, dilation, groups)
            if mask[0] else None,
            _weight_gradient(emit, grad, x, x_sizes, w_sizes, g_sizes, stride, padding, dilation, groups)
            if mask[1] else None,
            emit(relax.op.sum(grad, axis=[0, 2, 3])) if mask[2] else None)


def _input_gradient(emit, grad, weight, x_sizes, w_sizes, g_sizes, stride, padding, dilation, groups):
    """The transposed convolution of the output's gradient with the weight (OIHW read as IOHW), its
    output padding the rows and columns the forward's floor division dropped."""
    output_padding = [x_sizes[2 + a] - ((g_sizes[2 + a] - 1) * stride[a] - 2 * padding[a]
                                        + dilation[a] * (w_sizes[2 + a] - 1) + 1) for a in range(2)]
    return emit(relax.op.nn.conv2d_transpose(grad, weight, strides=stride, padding=padding,
                                             output_padding=output_padding, dilation=dilation, groups=groups,
                                             data_layout="NCHW", kernel_layout="IOHW", out_dtype=str(grad.ty.dtype)))


def _weight_gradient(emit, grad, x, x_sizes, w_sizes, g_sizes, stride, padding, dilation, groups):
    """grad_w[o, c, i, j] = sum over n, y, x of grad[n, o, y, x] * input[n, c, y*s + i*d - p, x*s + j*d - p]:
    a grouped convolution of the input as (C/groups, groups*N, H, W) with the gradient as its (O, N, Ho, Wo)
    kernel, stride and dilation swapped, cropped to the kernel's size and read back as (O, C/groups, kh, kw)."""
    n, c, h, w = x_sizes
    per_group = c // groups
    regrouped = emit(relax.op.reshape(x, (n, groups, per_group, h, w)))
    regrouped = emit(relax.op.permute_dims(regrouped, [2, 1, 0, 3, 4]))
    regrouped = emit(relax.op.reshape(regrouped, (per_group, groups * n, h, w)))
    kernel = emit(relax.op.permute_dims(grad, [1, 0, 2, 3]))
    full = emit(relax.op.nn.conv2d(regrouped, kernel, strides=dilation, padding=padding, dilation=stride,
                                   groups=groups, data_layout="NCHW", kernel_layout="OIHW",
                                   out_dtype=str(grad.ty.dtype)))
    full_sizes = [int(s) for s in full.ty.shape.values]
    if full_sizes[2:] != w_sizes[2:]:
        full = emit(relax.op.strided_slice(full, axes=[2, 3], begin=[0, 0], end=w_sizes[2:]))
    return emit(relax.op.permute_dims(full, [1, 0, 2, 3]))
