"""The CUDA kernels of a `ScatterAddPlan` (planning/scatter_add.py): out written, then atomic adds.

First launch: `plan.vector` consecutive elements of out per thread (the fill
constant, or data's elements). Second launch: a thread per (index tuple,
row element), consecutive threads along the row (a warp's loads of updates
and its atomic adds are contiguous); the thread reads the tuple's indices once,
skips an index outside its axis, and adds its update to out with
`tirx.cuda.atomic_add` (its result unused). The signature is (indices,
updates, out) for a fill, (data, indices, updates, out) for a copy.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T


def build(plan) -> tirx.PrimFunc:
    """The scheduled PrimFunc of `plan`."""
    with IRBuilder() as ib:
        with T.prim_func(is_private=True):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            data = T.arg("data", T.buffer(plan.out_shape, plan.dtype)) if plan.init == "copy" else None
            indices = T.arg("indices", T.buffer(plan.index_shape, plan.index_dtype))
            updates = T.arg("updates", T.buffer(plan.index_shape[:-1] + plan.out_shape[plan.slots:], plan.dtype))
            out = T.arg("out", T.buffer(plan.out_shape, plan.dtype))
            with T.sblock("root"):
                _init(plan, data, out)
                _scatter(plan, indices, updates, out)
    return ib.get()


def _init(plan, data, out) -> None:
    with T.thread_binding(plan.init_blocks, thread="blockIdx.x") as bx:
        with T.thread_binding(plan.threads, thread="threadIdx.x") as tx:
            first = (bx * plan.threads + tx) * plan.vector
            with T.If(first < plan.elements):  # proved true, and dropped, where the blocks divide out
                with T.Then():
                    with T.vectorized(plan.vector) as v:
                        at = _unflatten(first + v, plan.out_shape)
                        value = tirx.BufferLoad(data, at) if data is not None else tirx.const(plan.fill, plan.dtype)
                        T.buffer_store(out, value, at)


def _scatter(plan, indices, updates, out) -> None:
    total = plan.tuples * plan.row_elements
    wide = plan.elements >= 1 << 31
    with T.thread_binding(plan.scatter_blocks, thread="blockIdx.x") as bx:
        with T.thread_binding(plan.threads, thread="threadIdx.x") as tx:
            flat = bx * plan.threads + tx
            tuple_at = _unflatten(tirx.truncdiv(flat, plan.row_elements), plan.index_shape[:-1])
            element_at = _unflatten(tirx.truncmod(flat, plan.row_elements), plan.out_shape[plan.slots:])
            with T.If(flat < total):
                with T.Then():
                    picked = [T.bind(tirx.BufferLoad(indices, tuple_at + [tirx.const(k, "int32")]))
                              for k in range(plan.slots)]
                    inside = [tirx.all(p >= 0, p < plan.out_shape[k]) for k, p in enumerate(picked)]
                    where = [p.astype("int64" if wide else "int32") for p in picked]
                    element_out = [e.astype("int64") for e in element_at] if wide else element_at
                    add = tirx.call_intrin(plan.dtype, "tirx.cuda.atomic_add",
                                           tirx.address_of(tirx.BufferLoad(out, where + element_out)),
                                           tirx.BufferLoad(updates, tuple_at + element_at))
                    with T.If(tirx.all(*inside)):
                        with T.Then():
                            T.evaluate(add)


def _unflatten(flat, shape) -> list:
    """Row-major indices of `flat` into `shape` (each an expression of non-negative values)."""
    at = []
    for k, extent in enumerate(shape):
        inner = math.prod(shape[k + 1:])
        index = tirx.truncdiv(flat, inner) if inner > 1 else flat
        at.append(tirx.truncmod(index, extent) if k else index)
    return at

