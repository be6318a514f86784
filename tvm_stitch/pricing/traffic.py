"""Modeled global-memory traffic of a (scheduled) PrimFunc, and the ideal for its inputs and outputs.

Model: every block instance executes once (the block's iteration domain);
per instance it loads each distinct global element it reads once (NVVM and
LLVM merge repeated loads of one address in one expression) and stores its
result once per spatial instance. Global buffers are the function's
parameters and root allocations in global scope; shared and local buffers
are on chip and cost nothing here.

A buffer that fits a share (*_RESIDENT_PER_MILLE) of the target's
last-level cache (the spec's `cache_bytes`: L2 on CUDA) and is read many
times (a gamma broadcast over every row) is counted once: after the first
pass it is served from the cache, not device memory, while the kernel
streams the rest through it. Larger buffers are counted at every read.

Ideal: each input read once, each output written once; an input no block
reads whole (an embedding table read through a gather, a slice) counts at
most the elements of the block that reads it least: a gathered row is read
once per use.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from schedules.cuda.combine_in_launch import MOVED_TRAFFIC
from tvm_stitch.analysis.tir_view import buffer_params, static_product
from tvm_stitch.planning.spec import CPU_RESIDENT_PER_MILLE, CUDA_RESIDENT_PER_MILLE, TargetSpec



@dataclass(frozen=True)
class Traffic:
    loaded: int  # bytes
    stored: int
    ideal: int

    @property
    def total(self) -> int:
        return self.loaded + self.stored


def _dtype_bytes(buffer) -> int:
    return max(1, buffer.dtype.bits // 8)


def _global(buffer, params: list, root_allocs: list) -> bool:
    if any(buffer.same_as(p) for p in params):
        return True
    return any(buffer.same_as(a) for a in root_allocs) and buffer.scope() == "global"


def modeled_traffic(func: tirx.PrimFunc, spec: TargetSpec) -> Traffic | None:
    """Bytes the function moves to and from device memory on `spec`'s target; None for symbolic shapes.
    A kernel built from a plan that models its own traffic (a fused attention kernel) records it in
    its `tvm_stitch.traffic` attribute: (loaded, stored, ideal); one whose combine moved out of blocks
    (schedules/cuda/combine_in_launch) records what those accesses move (added here)."""
    recorded = func.attrs.get("tvm_stitch.traffic") if func.attrs is not None else None
    if recorded is not None:
        return Traffic(*(int(x) for x in recorded))
    params = buffer_params(func)
    root = func.body.block if isinstance(func.body, s_tir.SBlockRealize) else None
    root_allocs = list(root.alloc_buffers) if root is not None else []
    loads: list = []  # (buffer, elements loaded)
    first_reads: list = []  # (buffer, instances of a block that loads it)
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
        for k, (buffer, _) in enumerate(seen):
            if any(buffer.same_as(w) for w in written):
                continue  # the accumulator of a reduction: read back from where it is written
            loads.append((buffer, domain))
            if not any(buffer.same_as(b) for b, _ in seen[:k]):
                first_reads.append((buffer, domain))
        for buffer in written:
            if _global(buffer, params, root_allocs):
                stored += spatial * _dtype_bytes(buffer)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, on_block), order="pre")
    if symbolic:
        return None
    share = CUDA_RESIDENT_PER_MILLE if spec.family == "cuda" else CPU_RESIDENT_PER_MILLE
    resident = spec.cache_bytes * share // 1000
    loaded = 0
    distinct = []
    for buffer, _ in loads:
        if not any(buffer.same_as(d) for d in distinct):
            distinct.append(buffer)
    for buffer in distinct:
        elements = sum(n for b, n in loads if b.same_as(buffer))
        size = static_product(buffer.shape)
        if size is not None and size * _dtype_bytes(buffer) <= resident:
            elements = min(elements, size)
        loaded += elements * _dtype_bytes(buffer)
    ideal = 0
    for param in params:
        size = static_product(param.shape)
        if size is None:
            return None
        reads = [n for b, n in first_reads if b.same_as(param)]
        ideal += min([size] + reads) * _dtype_bytes(param)
    moved = func.attrs.get(MOVED_TRAFFIC) if func.attrs is not None else None
    if moved is not None:
        loaded, stored = loaded + int(moved[0]), stored + int(moved[1])
    return Traffic(loaded, stored, ideal)
