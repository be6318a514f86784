"""A whole module priced by the CUDA time model: stitched and TVM's default build alike.

`lowered` is a module after a Relax pipeline (ours, or TVM's default one:
every PrimFunc scheduled, nothing built yet). Every PrimFunc a Relax
function calls is priced as scheduled (pricing/modeled_time.py), once per
call; a stitched kernel uses its plan's register estimate, others
time_model.DEFAULT_REGISTERS.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import kernel_bound_lines
from tvm_stitch.stitch import DEFAULT_FUSION
from tvm_stitch.target import as_target, default_pipeline
from tvm_stitch.tools.launches import primfunc_calls


@dataclass(frozen=True)
class ModuleTime:
    us: float  # modeled microseconds of one call of every Relax function (-1: some kernel not priced)
    launches: int
    kernels: tuple  # (PrimFunc name, calls, KernelTime of each of its kernels)
    unpriced: tuple  # PrimFuncs that could not be priced (symbolic sizes without bounds)
    stitched: frozenset = frozenset()  # PrimFuncs the stitch pass made (a plan, or a packed launch of plans)
    compute: frozenset = frozenset()  # PrimFuncs left to TVM's rules that contract two tensors (matmul, conv)

    def over(self, nbytes: int, stitched_only: bool = False) -> list:
        """KernelTimes of the kernels that move at least `nbytes` (of stitched PrimFuncs only, if asked)."""
        return [t for name, _, times in self.kernels for t in times
                if t.bytes >= nbytes and (name in self.stitched or not stitched_only)]

    def compute_us(self) -> float:
        """Modeled microseconds of the compute-intensive PrimFuncs' calls (matmuls, convolutions)."""
        return sum(calls * sum(t.us for t in times) for name, calls, times in self.kernels if name in self.compute)


def _registers(func) -> int:
    text = func.attrs.get("tvm_stitch.plan") if func.attrs is not None else None
    return StitchPlan.from_json(str(text)).registers if text is not None else -1


def module_time(lowered: tvm.IRModule, spec: TargetSpec) -> ModuleTime:
    """The modeled time of one call of every Relax function of `lowered`."""
    calls = primfunc_calls(lowered)
    kernels, unpriced = [], []
    total, launches = 0.0, 0
    for gv, func in lowered.functions_items():
        name = gv.name_hint
        if name not in calls:
            continue
        times = modeled_times(func, spec, _registers(func), name)
        if times is None:
            unpriced.append(name)
            continue
        kernels.append((name, calls[name], tuple(times)))
        total += calls[name] * sum(t.us for t in times)
        launches += calls[name] * len(times)
    funcs = dict(lowered.functions_items())
    attrs = {gv.name_hint: func.attrs or {} for gv, func in funcs.items()}
    stitched = frozenset(n for n, _, _ in kernels if "tvm_stitch.plan" in attrs[n] or "tvm_stitch.packed" in attrs[n])
    # A stitched row of sum(a * b) reads like a contraction: compute means left to TVM's rules.
    compute = frozenset(gv.name_hint for gv, func in funcs.items()
                        if gv.name_hint in calls and gv.name_hint not in stitched
                        and isinstance(func, tvm.tirx.PrimFunc) and is_compute_kernel(func))
    return ModuleTime(total if not unpriced else -1.0, launches, tuple(kernels), tuple(unpriced), stitched, compute)


def default_module_time(mod: tvm.IRModule, target, spec: TargetSpec) -> ModuleTime:
    """TVM's default build of `mod` for the CUDA `target`, priced by the same model."""
    target = as_target(target)
    with target:
        lowered = default_pipeline(target)(tvm.IRModule(mod.functions, attrs=mod.attrs))
    return module_time(lowered, spec)


def stitched_module_time(mod: tvm.IRModule, target, spec: TargetSpec, fusion: str = DEFAULT_FUSION,
                         allow_tf32: bool = False, report=None) -> ModuleTime:
    """`mod` built by the stitch pipeline for the CUDA `target` (grouped by `fusion`; float32 GEMMs on TF32
    tensor cores with `allow_tf32`; `report`: a StitchReport the pipeline fills), priced."""
    from tvm_stitch.pipeline import pipeline

    target = as_target(target)
    with target:
        lowered = pipeline(target, fusion=fusion, allow_tf32=allow_tf32, report=report)(
            tvm.IRModule(mod.functions, attrs=mod.attrs))
    return module_time(lowered, spec)


def comparison(mod: tvm.IRModule, target, spec: TargetSpec, fusion: str = DEFAULT_FUSION, bounds: bool = False) -> str:
    """One line: the module's modeled time stitched (grouped by `fusion`) beside TVM's default build, both
    priced by the model; with `bounds`, then each build's kernels with their bound and share of the peaks
    (report.kernel_bound_lines), and the schedule kept for each GEMM the tensor-core rule took, with
    both schedules' modeled times (pricing/gemm_choice.py)."""
    from tvm_stitch.report import StitchReport

    report = StitchReport()
    stitched = stitched_module_time(mod, target, spec, fusion, report=report)
    default = default_module_time(mod, target, spec)
    line = _comparison_line(stitched, default, spec)
    if not bounds:
        return line
    return "\n".join([line] + kernel_bound_lines("kernels of the stitched build:", stitched.kernels)
                     + [choice.line() for choice in report.gemms]
                     + kernel_bound_lines("kernels of TVM's default build:", default.kernels))


def _comparison_line(stitched: ModuleTime, default: ModuleTime, spec: TargetSpec) -> str:
    def part(what: str, priced: ModuleTime) -> str:
        if priced.us < 0:
            return f"{what}: not priced ({', '.join(priced.unpriced)}: symbolic sizes without bounds)"
        return f"{what} {priced.us:.1f} us in {priced.launches} launches"

    ratio = f" ({default.us / stitched.us:.2f}x)" if stitched.us > 0 and default.us > 0 else ""
    return (f"modeled time of the module on {spec.arch} (every kernel priced by the time model): "
            f"{part('stitched', stitched)}; {part('TVM default', default)}{ratio}")
