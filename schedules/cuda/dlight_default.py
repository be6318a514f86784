"""dlight's default GPU rules, tried in order on one PrimFunc, as TVM's default CUDA build applies them.

Where the installed apache-tvm-ffi makes TVM's Tensorize segfault
(schedules/tensorize_guard.py), the PrimFunc is opted out of tensorization
first, so no caller can reach the fault.
"""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from schedules.tensorize_guard import tensorize_faults, without_tensorize


def first_dlight_schedule(func: tirx.PrimFunc, target: Target):
    """(schedule, rule name) of the first of dlight's default GPU rules that applies; (None, None) if none."""
    from tvm.s_tir import dlight as dl

    func = without_tensorize(func) if tensorize_faults() else func
    for rule in (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()):
        try:
            sch = rule.apply(func, target, False)
        except Exception:  # noqa: BLE001 - a crashing dlight rule means: try the next one
            sch = None
        if isinstance(sch, list):
            sch = sch[0] if sch else None
        if sch is not None:
            return sch, type(rule).__name__
    return None, None
