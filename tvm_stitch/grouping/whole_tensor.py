"""Whole-tensor reductions with their producers: the groups partition may form at rank 0 though
they are large.

A reduction of a whole tensor to a scalar (a loss mean, a global gradient
norm) shares no row axis with anything, so the row rule would keep its
element-wise producers in a kernel of their own, writing the tensor that the
reduction reads back. Such a union is stitched by the column-split scheme
instead (planning/cuda/column_split.py: blocks reduce chunks to partials, one
block combines them), when it is:

- one or more full reductions of inputs of one static size E;
- element-wise or broadcast producers of E elements, none of which reads a
  reduction of the union (a value needed before the reductions end cannot
  be in the same pass);
- scalar epilogues (at most one element: the mean's divide, the norm's sqrt).
"""

from __future__ import annotations

from tvm_stitch.analysis.classify import OpKind
from tvm_stitch.analysis.graph import Graph
from tvm_stitch.analysis.tir_view import buffer_params, static_product


def _elements(ty) -> int | None:
    return static_product(list(ty.shape)) if ty.shape is not None else None


def _input_elements(graph: Graph, index: int) -> set:
    op = graph.ops[index]
    return {static_product(list(p.shape)) for p in buffer_params(op.func)[:len(op.inputs)]}


def whole_tensor_group(graph: Graph, op_ids: set) -> bool:
    """Whether the ops `op_ids` are a whole-tensor reduction with its producers and scalar epilogues."""
    full = {i for i in op_ids if graph.ops[i].cls.reduce_where == "full"}
    if not full or any(graph.ops[i].cls.kind == OpKind.REDUCTION for i in op_ids - full):
        return False
    sizes = set().union(*(_input_elements(graph, i) for i in full))
    if len(sizes) != 1 or None in sizes:
        return False
    (size,) = sizes
    after = set(full)
    for i in sorted(op_ids):
        if any(ref.op in after for ref in graph.ops[i].inputs):
            after.add(i)
    for i in op_ids - full:
        op = graph.ops[i]
        if op.cls.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST):
            return False
        outputs = {_elements(t) for t in op.out_types}
        if i in after and outputs != {1}:
            return False
        if i not in after and outputs != {size}:
            return False
    return True
