"""A matmul's or convolution's kernels as the time model prices them: arithmetic-bound tiles with L2 reuse.

A contraction left to TVM's rules (dlight's Matmul, tensorized or not, and
its convolutions) stages tiles of its operands in shared memory: every
block loads the panels of both operands its output tile needs, so the
bytes its tiles load (the geometry's `accessed_bytes`) are many times its
operands. Most of those loads are served by the L2, which holds the panels
the resident blocks share: device memory moves each operand once while
the operands fit the L2, else once per L2-full of them (the operands are
streamed through it in that many passes), and never more than the tiles
load. The kernel is marked `contraction`: its loads wait for device memory
only in that proportion (planning/time_model.py), the rest overlapping the
resident blocks' arithmetic. A kernel that stages nothing in shared memory
(a matrix-vector product) is priced as it loads.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.pricing.traffic import Traffic
from tvm_stitch.planning.spec import TargetSpec

STITCHED = ("tvm_stitch.plan", "tvm_stitch.packed", "tvm_stitch.attention")  # kernels priced as planned


def is_contraction(func: tirx.PrimFunc, registers: int) -> bool:
    """Whether a scheduled PrimFunc is a contraction left to TVM's rules (no plan's registers, no
    stitched kernel's attribute, two tensors contracted)."""
    attrs = func.attrs or {}
    return registers < 0 and not any(key in attrs for key in STITCHED) and is_compute_kernel(func)


def contraction_dram_bytes(traffic: Traffic, accessed: int, spec: TargetSpec) -> int:
    """Device-memory bytes of a tiled contraction: its outputs once, its operands once per L2-full
    of them (at least once), at most the bytes its tiles load."""
    passes = max(1, -(-traffic.loaded // max(1, spec.cache_bytes)))
    return min(max(accessed, traffic.total), traffic.stored + traffic.loaded * passes)


def as_contraction(geometries: list, traffic: Traffic, spec: TargetSpec) -> list:
    """The kernels that stage tiles in shared memory marked `contraction`, with the L2-reuse traffic
    shared among them by the bytes they access; the others as they are."""
    tiled = [g for g in geometries if g.shared_bytes > 0 and g.accessed_bytes > 0]
    if not tiled:
        return geometries
    accessed = sum(g.accessed_bytes for g in geometries)
    dram = contraction_dram_bytes(traffic, accessed, spec)
    return [dataclasses.replace(g, contraction=g.shared_bytes > 0, dram_bytes=dram * g.accessed_bytes // accessed)
            for g in geometries]
