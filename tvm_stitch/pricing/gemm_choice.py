"""A GEMM's schedule chosen in time: the tensor-core rule's and TVM's default (dlight's) priced alike.

Where schedules/cuda/tensor_core_matmul schedules a GEMM, dlight's default
GPU rules schedule the same PrimFunc too (its Matmul rule: wmma tensor cores
for float16 extents over 64, else FMA), and both are priced by the time model
(modeled_time.modeled_times, as the contractions they are). The tensor-core
schedule is kept unless dlight's is modeled faster by more than TIE; it is
kept as well where either is not priced (symbolic sizes without bounds, a
lowering that fails) or dlight schedules nothing. dlight's schedule is a
candidate only where it runs on tensor cores too (its wmma path): its FMA
schedule of a GEMM the rule puts on tensor cores is not taken, whatever the
model says of a small GEMM's latency (every half-precision GEMM of a model
carries mma instructions; dlight's FMA schedules of the models' backward
GEMMs also spill registers under ptxas). Nor is a schedule that would spill:
dlight's is no candidate where a kernel's registers per thread, estimated
from its fragments (pricing/gemm_registers.py), exceed what its block's size
allows (its wmma schedule of 512 threads is capped at 128 registers and
spilled 8 bytes in LLaMA's float16 backward on sm_80, the product whose
operand is RoPE's backward). The choice is a `GemmChoice`: the rule kept,
both modeled times and the reason in words.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

from schedules.cuda import tensor_core_matmul
from schedules.cuda.dlight_default import first_dlight_schedule
from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.pricing.gemm_registers import over_cap
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.pricing.timed_choice import TIE
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us

RULE_ATTR = "tvm_stitch.schedule_rule"
TENSOR_CORE_OPS = frozenset({"tirx.tvm_mma_sync", "tirx.tvm_bmma_sync", "tirx.ptx_legacy.mma", "tirx.ptx.mma"})


@dataclass(frozen=True)
class GemmChoice:
    """The schedule kept for one GEMM PrimFunc and why."""

    kernel: str
    rule: str  # TENSOR_CORE_RULE or the dlight rule's class name
    tensor_core_us: float  # modeled; -1: not priced
    default_us: float  # dlight's schedule, modeled; -1: not priced or no dlight schedule
    default_rule: str = ""
    default_on_tensor_cores: bool = True  # dlight's schedule multiplies on tensor cores (else not a candidate)
    default_registers: tuple = ()  # (estimate, cap) of dlight's kernel over its register cap (not a candidate)

    @property
    def timed(self) -> bool:
        return self.tensor_core_us >= 0 and self.default_us >= 0

    def line(self) -> str:
        if not self.timed:
            return (f"GEMM {self.kernel}: {self.rule} (not timed: "
                    f"{'no dlight schedule' if not self.default_rule else 'a schedule not priced'})")
        kept, other = ((self.tensor_core_us, self.default_us) if self.rule == TENSOR_CORE_RULE
                       else (self.default_us, self.tensor_core_us))
        rival = self.default_rule if self.rule == TENSOR_CORE_RULE else TENSOR_CORE_RULE
        return (f"GEMM {self.kernel}: {self.rule}, modeled {kept:.1f} us against {rival}'s {other:.1f} us"
                f"{self._excluded()} (time model)")

    def _excluded(self) -> str:
        """Why dlight's schedule was no candidate, if it was not."""
        if not self.default_on_tensor_cores:
            return ", on FMA units: not a candidate"
        if self.default_registers:
            estimate, cap = self.default_registers
            return f", {estimate} registers per thread estimated over its cap of {cap}: not a candidate"
        return ""


def scheduled(sch, rule: str) -> tirx.PrimFunc:
    """The PrimFunc of a schedule marked scheduled by `rule` (the tensor-core rule's: tensor_core_matmul.kernel)."""
    func = tensor_core_matmul.kernel(sch) if rule == TENSOR_CORE_RULE else sch.mod["main"]
    return func.with_attrs({"tirx.is_scheduled": True, RULE_ATTR: rule})


def _us(func: tirx.PrimFunc, spec: TargetSpec, name: str) -> float:
    times = modeled_times(func, spec, -1, name)
    return total_us(times) if times else -1.0


def on_tensor_cores(func: tirx.PrimFunc) -> bool:
    """Whether a scheduled PrimFunc multiplies on tensor cores (a wmma or mma intrinsic)."""
    names = []

    def visit(call):
        if isinstance(call.op, tvm.ir.Op):
            names.append(call.op.name)

    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, visit), order="pre")
    return any(name in TENSOR_CORE_OPS for name in names)


def faster_gemm(func: tirx.PrimFunc, tensor_core, target: Target, spec: TargetSpec, name: str = "") -> tuple:
    """(scheduled PrimFunc, GemmChoice) of `func`: its `tensor_core` schedule (tensor_core_matmul.apply's)
    or dlight's default schedule of it, whichever the time model prices faster (see the module)."""
    mine = scheduled(tensor_core, TENSOR_CORE_RULE)
    if spec.hbm_bytes_per_us <= 0:  # a spec without the time model's constants: nothing to time
        return mine, GemmChoice(name, TENSOR_CORE_RULE, -1.0, -1.0)
    default, rule = first_dlight_schedule(func, target)
    if default is None:
        return mine, GemmChoice(name, TENSOR_CORE_RULE, _us(mine, spec, name), -1.0)
    theirs = scheduled(default, rule)
    mine_us, theirs_us = _us(mine, spec, name), _us(theirs, spec, name)
    faster = mine_us >= 0 and 0 <= theirs_us < mine_us * (1 - TIE)
    tensor_cores = on_tensor_cores(theirs)
    spilling = over_cap(theirs, spec, name) if faster and tensor_cores else None
    if faster and tensor_cores and spilling is None:
        return theirs, GemmChoice(name, rule, mine_us, theirs_us, rule)
    registers = (spilling.estimate, spilling.cap) if spilling is not None else ()
    return mine, GemmChoice(name, TENSOR_CORE_RULE, mine_us, theirs_us, rule, tensor_cores, registers)
