"""A matmul reading through its producers (a folded prologue) priced against the two apart (CUDA).

Folding a producer into a matmul saves its launch and the round trip of its
result through device memory, but the matmul then recomputes the producer
for every tile that loads its elements: each of its loads becomes the
producer's loads (a rotary embedding's four, a gather's select of two). A
matmul with few threads is bound by its loads' latency (time_model.py), so
the fold can cost more than it saves. The folded PrimFunc and the matmul
alone are priced by the time model as dlight's Matmul rule schedules them
(as TVM's default build would); the producers apart as one stitched kernel
at its best: one launch, their inputs read and their results written once at
the achievable bandwidth. Apart, they may instead join a stitched kernel
that is launched anyway (no launch of their own): the comparison then leans
towards folding by a launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.target import Target

from schedules.cuda.dlight_default import first_dlight_schedule
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us


@dataclass(frozen=True)
class FoldPrice:
    """Modeled microseconds of the folded matmul and of the matmul and its producers apart (-1: not priced)."""

    folded_us: float
    apart_us: float

    @property
    def pays(self) -> bool:
        """Whether to fold: the folded matmul is not slower, or a side could not be priced."""
        return self.folded_us < 0 or self.apart_us < 0 or self.folded_us <= self.apart_us


def default_us(func: tirx.PrimFunc, target: Target, spec: TargetSpec) -> float:
    """Modeled microseconds of `func` as dlight schedules it; -1.0 where it cannot be priced."""
    sch, _ = first_dlight_schedule(func, target)
    scheduled = sch.mod["main"] if sch is not None else None
    times = modeled_times(scheduled, spec) if scheduled is not None else None
    return total_us(times) if times else -1.0


def fold_price(folded: tirx.PrimFunc, matmul: tirx.PrimFunc, producer_bytes: int, target: Target,
               spec: TargetSpec) -> FoldPrice:
    """The folded PrimFunc against `matmul` and a kernel of its producers moving `producer_bytes`
    (their inputs and the results the matmul reads; negative: unknown, not priced)."""
    folded_us = default_us(folded, target, spec)
    matmul_us = default_us(matmul, target, spec)
    if matmul_us < 0 or producer_bytes < 0:
        return FoldPrice(folded_us, -1.0)
    return FoldPrice(folded_us, matmul_us + spec.launch_us + producer_bytes / spec.hbm_bytes_per_us)
