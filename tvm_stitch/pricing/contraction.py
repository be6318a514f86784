"""A matmul's or convolution's kernels as the time model prices them: arithmetic with L2 reuse.

A contraction left to TVM's rules (dlight's Matmul, tensorized or not, and
its convolutions) reads each operand element many times: every block loads
the panels of both operands its output tile needs (into shared memory, or
a convolution's windows straight from global memory), so the bytes its
threads load (the geometry's `accessed_bytes`) are many times its operands.
Most of those loads are served by the caches, which hold what the resident
blocks share: device memory moves each operand once while the operands fit
the L2, else once per L2-full of them (the operands are streamed through it
in that many passes), and never more than the threads load. The kernel is
marked `contraction`: its loads wait for device memory only in that
proportion (planning/time_model.py), the rest overlapping the resident
blocks' arithmetic. Where nothing is re-read (a matrix-vector product), the
proportion is about one: it is priced as it loads.
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
    """Device-memory bytes of a tiled contraction: its outputs once, its operands (the ideal traffic
    less the outputs) once per L2-full of them (at least once), at most the bytes its tiles load."""
    operands = max(0, traffic.ideal - traffic.stored)
    passes = max(1, -(-operands // max(1, spec.cache_bytes)))
    return min(max(accessed, traffic.total), traffic.stored + operands * passes)


def as_contraction(geometries: list, traffic: Traffic, spec: TargetSpec) -> list:
    """The kernels marked `contraction`, with the L2-reuse traffic shared among them by the bytes they
    access."""
    accessed = sum(g.accessed_bytes for g in geometries)
    if not accessed:
        return geometries
    dram = contraction_dram_bytes(traffic, accessed, spec)
    return [dataclasses.replace(g, contraction=True, dram_bytes=dram * g.accessed_bytes // accessed)
            for g in geometries]
