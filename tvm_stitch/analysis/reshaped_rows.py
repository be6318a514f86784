"""Rows that come through a reshape: lay the blocks that reshape them back out over the rows.

A GroupNorm reshapes (N, C, H, W) to (N, G, C/G*H*W), reduces each group and
reshapes the normalised groups back: its last block iterates (N, C, H, W)
and reads the grouped tensor at flattened-and-split indices, so the blocks
share only the batch as a leading row axis (N rows of G groups each, too few
for a GPU). Such a block (spatial, reading one tensor the kernel produces,
of as many elements as it iterates, through indices that are a bijection
of its iterators) is re-laid out over that tensor's shape (s_tir
`transform_block_layout` with the read indices as the map): it then reads
the grouped tensor at its own iterators and writes the kernel's output as
a strided slice per group (c = g * C/G + r), which row alignment accepts for
functions marked with ROW_AXES_ATTR. The rows are then (N, G).

The plan records the re-laid blocks by name (`StitchPlan.reshaped`) and the
schedules redo the same rewrite (schedules/__init__.py).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx

from tvm_stitch.analysis.row_axes import ROW_AXES_ATTR
from tvm_stitch.analysis.tir_view import block_views, buffer_params, static_product


def reshaping_blocks(func: tirx.PrimFunc) -> tuple:
    """Names of the spatial blocks that read one tensor the kernel produces, of as many elements
    as they iterate, at indices other than their own iterators (a reshape of it), in program order."""
    views = block_views(s_tir.Schedule(func))
    params = buffer_params(func)
    produced = [w.buffer for v in views for w in v.writes if not any(w.buffer.same_as(p) for p in params)]
    found = []
    for view in views:
        inner = [r for r in view.reads if any(r.buffer.same_as(b) for b in produced)]
        if view.has_reduction or len(inner) != 1 or len(view.writes) != 1:
            continue
        read = inner[0]
        size = static_product(view.extents)
        if size is None or size != static_product(read.buffer.shape):
            continue
        plain = len(read.indices) == len(view.iter_vars) and all(
            isinstance(i, tirx.Var) and i.same_as(v) for i, v in zip(read.indices, view.iter_vars))
        if not plain:
            found.append(view.name)
    return tuple(found)


def rows_through_reshape(func: tirx.PrimFunc, names: tuple) -> tirx.PrimFunc:
    """`func` with each block of `names` iterating the shape of the tensor it reshapes, its
    indices simplified, marked with ROW_AXES_ATTR; s_tir.ScheduleError where a block's read
    indices are not a bijection of its iterators."""
    sch = s_tir.Schedule(func)
    for name in names:
        block = sch.get(sch.get_sblock(name))
        (read,) = [r for r in block.reads if not any(r.source.same_as(p) for p in buffer_params(func))]
        indices = [r.min for r in read.region]
        sch.transform_block_layout(sch.get_sblock(name),
                                   tirx.IndexMap([iv.var for iv in block.iter_vars], indices, None))
    moved = sch.mod["main"]
    simplified = {name: _simplified(sch.get(sch.get_sblock(name))) for name in names}
    body = tvm_ffi.structural_map(moved.body, (s_tir.SBlock, lambda b: simplified.get(b.name_hint, b)))
    return moved.with_body(body).with_attr(ROW_AXES_ATTR, True)


def _simplified(block):
    """`block` with the indices of its loads, stores and regions simplified over its iterators' ranges."""
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)

    def simple(indices) -> list:
        return [analyzer.simplify(i) for i in indices]

    body = tvm_ffi.structural_map(block.body, (tvm.ir.TensorLoad,
                                               lambda load: tirx.BufferLoad(load.source, simple(load.indices))))
    body = tvm_ffi.structural_map(body, (tirx.BufferStore,
                                         lambda s: tirx.BufferStore(s.buffer, s.value, simple(s.indices))))

    def region(r):
        return tirx.BufferRegion(r.source, [tvm.ir.Range.from_min_extent(analyzer.simplify(x.min), x.extent)
                                            for x in r.region])

    return s_tir.SBlock(block.iter_vars, [region(r) for r in block.reads], [region(w) for w in block.writes],
                        block.name_hint, body, block.init, block.alloc_buffers, block.match_buffers,
                        block.annotations)
