"""Modeled global-memory traffic of a (scheduled) PrimFunc, and the ideal for its inputs and outputs.

Model: every block instance executes once (the block's iteration domain);
per instance it loads each distinct global element it reads once (NVVM and
LLVM merge repeated loads of one address in one expression) and stores its
result once per spatial instance. Global buffers are the function's
parameters and root allocations in global scope; shared and local buffers
are on chip and cost nothing here.

A buffer of at most `L2_RESIDENT_BYTES` that is read many times (a gamma
broadcast over every row) is counted once: after the first pass it is
served from L2 (50 MB on H100/H200), not device memory. Larger buffers are
counted at every read.

Ideal: each input read once, each output written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_stitch.analysis.tir_view import buffer_params, static_product


L2_RESIDENT_BYTES = 4 << 20


@dataclass(frozen=True)
class Traffic:
    loaded: int  # bytes
    stored: int
    ideal: int

    @property
    def total(self) -> int:
        return self.loaded + self.stored

    @property
    def ratio(self) -> float:
        """Modeled over ideal: 1.0 means every input read once and every output written once."""
        return self.total / self.ideal if self.ideal else 1.0


def _dtype_bytes(buffer) -> int:
    return max(1, buffer.dtype.bits // 8)


def _global(buffer, params: list, root_allocs: list) -> bool:
    if any(buffer.same_as(p) for p in params):
        return True
    return any(buffer.same_as(a) for a in root_allocs) and buffer.scope() == "global"


def modeled_traffic(func: tirx.PrimFunc) -> Traffic | None:
    """Bytes the function moves to and from device memory; None for symbolic shapes."""
    params = buffer_params(func)
    root = func.body.block if isinstance(func.body, s_tir.SBlockRealize) else None
    root_allocs = list(root.alloc_buffers) if root is not None else []
    loads: list = []  # (buffer, elements loaded)
    stored = 0
    symbolic = False

    def on_block(block):
        nonlocal stored, symbolic
        if block.name_hint == "root":
            return
        domain = static_product([iv.dom.extent for iv in block.iter_vars])
        spatial = static_product([iv.dom.extent for iv in block.iter_vars if iv.iter_type != tirx.IterVar.CommReduce])
        if domain is None or spatial is None:
            symbolic = True
            return
        seen = []

        def on_load(load):
            if not _global(load.source, params, root_allocs):
                return
            if any(load.source.same_as(b) and tvm_ffi.structural_equal(list(load.indices), i) for b, i in seen):
                return
            seen.append((load.source, list(load.indices)))

        tvm_ffi.structural_walk(block.body, (tvm.ir.TensorLoad, on_load), order="post")
        written = [w.source for w in block.writes]
        for buffer, _ in seen:
            if any(buffer.same_as(w) for w in written):
                continue  # the accumulator of a reduction: read back from where it is written
            loads.append((buffer, domain))
        for buffer in written:
            if _global(buffer, params, root_allocs):
                stored += spatial * _dtype_bytes(buffer)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, on_block), order="pre")
    if symbolic:
        return None
    loaded = 0
    distinct = []
    for buffer, _ in loads:
        if not any(buffer.same_as(d) for d in distinct):
            distinct.append(buffer)
    for buffer in distinct:
        elements = sum(n for b, n in loads if b.same_as(buffer))
        size = static_product(buffer.shape)
        if size is not None and size * _dtype_bytes(buffer) <= L2_RESIDENT_BYTES:
            elements = min(elements, size)
        loaded += elements * _dtype_bytes(buffer)
    ideal = 0
    for param in params:
        size = static_product(param.shape)
        if size is None:
            return None
        ideal += size * _dtype_bytes(param)
    return Traffic(loaded, stored, ideal)


def program_traffic(lowered: tvm.IRModule) -> tuple:
    """(modeled bytes of one call of every Relax function, ideal bytes of `main`'s signature).

    Modeled: for every PrimFunc call, that PrimFunc's modeled traffic. Ideal:
    `main`'s tensor inputs read once and its outputs written once.
    """
    from tvm import relax

    from tvm_stitch.tools.launches import primfunc_calls

    calls = primfunc_calls(lowered)
    modeled = 0
    for gv, func in lowered.functions_items():
        if gv.name_hint in calls:
            traffic = modeled_traffic(func)
            if traffic is None:
                return -1, -1
            modeled += calls[gv.name_hint] * traffic.total
    main = lowered["main"]
    tensors = [p.ty for p in main.params] + _leaves(main.ret_ty)
    ideal = 0
    for ty in tensors:
        if isinstance(ty, relax.TensorType) and ty.shape is not None:
            size = static_product(list(ty.shape))
            if size is None:
                return modeled, -1
            ideal += size * max(1, tvm.DataType(str(ty.dtype)).bits // 8)
    return modeled, ideal


def _leaves(ty) -> list:
    from tvm import relax

    if isinstance(ty, relax.TupleType):
        return [leaf for field in ty.fields for leaf in _leaves(field)]
    return [ty]
