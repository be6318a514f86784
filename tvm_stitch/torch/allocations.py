"""A converter for `aten.new_empty_strided`, which TVM 0.27's exported-program importer lacks.

Compiled autograd's graphs allocate each gradient's buffer with it (DDP's
python reducer copies a gradient into it before the all-reduce). Its
contents are undefined and the graph is functional, so it is zeros of
its size and dtype (TVM's outputs are contiguous; the strides asked for
only say how PyTorch would lay the buffer out).
"""

from __future__ import annotations

from tvm import relax


def converters() -> dict:
    return {"new_empty_strided.default": _new_empty_strided}


def _new_empty_strided(node, importer):
    x = importer.env[node.args[0]]
    size = importer.retrieve_args(node)[1]
    dtype = node.kwargs.get("dtype")
    dtype = importer._convert_data_type(dtype, importer.env) if dtype is not None else x.ty.dtype
    return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(list(size)), dtype))
