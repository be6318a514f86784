"""SIMT checks of the stitched CUDA kernels, without a GPU: OpenCL on pocl, or under Oclgrind.

    import tvm_stitch.simt
    report = tvm_stitch.simt.check(mod)            # pocl: numerics and guard zones
    report = tvm_stitch.simt.check(mod, oclgrind=True)  # + races, out-of-bounds, uninitialised reads
    print(report); assert report.ok

Every stitched kernel of `mod` planned for the CUDA target gets the
product's plan and schedule (StitchFusion's own code, thread bindings and
on-chip scopes included), is built with TVM's OpenCL code generator and
launched with the grid and block of its thread bindings, every phase in
order; its outputs are compared with its fused PrimFunc unscheduled, built
for llvm. See tvm_stitch/simt/simt_kernel.py for the statuses.

Under Oclgrind, a kernel whose launch the simulator cannot hold (its
32 KB of local memory) is planned again within it and that plan is
checked, with a note saying so (tvm_stitch/simt/oclgrind_fit.py). A kernel
whose last blocks combine partials in the same launch is checked with the
last block alone combining (tvm_stitch/simt/last_block.py).

A kernel of symbolic shape is built once, symbolic, and run at a few values
of its variables: the lower bound, an odd value and the upper bound that
the module's Relax functions record (`tir_var_lower_bound`,
`tir_var_upper_bound`), or the values given in `sizes`; see
tvm_stitch/simt/symbolic_sizes.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

import tvm
from tvm import tirx

from tvm_stitch.simt.simt_kernel import KernelCheck, Reference, check_kernel
from tvm_stitch.simt.simt_inputs import written_params
from tvm_stitch.simt.symbolic_sizes import describe, recorded_bounds, size_points
from tvm_stitch.simt import oclgrind_fit, opencl_run
from tvm_stitch.simt.last_block import last_block_combining
from tvm_stitch.pricing.timed_choice import choose_in_time
from tvm_stitch.kernels.variants import ATTR as VARIANTS, branch_at
from tvm_stitch.pipeline import grouping_passes
from tvm_stitch.planning import cost_model
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch import DEFAULT_FUSION, stitch_module
from tvm_stitch.target import as_target

DEFAULT_TARGET = MappingProxyType({"kind": "cuda", "arch": "sm_90"})

__all__ = ["check", "SimtReport", "KernelCheck"]


@dataclass
class SimtReport:
    kernels: list = field(default_factory=list)  # KernelCheck per stitched PrimFunc
    stitch: StitchReport | None = None  # what StitchFusion decided
    platform: str = ""

    @property
    def ok(self) -> bool:
        return all(k.ok for k in self.kernels)

    def lines(self) -> list:
        out = []
        for k in self.kernels:
            error = f"{k.max_error:.2e}" if k.max_error == k.max_error else "-"
            out.append(f"{k.status:13s} {k.name:40s} launches {k.launches}  max error {error}  {k.detail}")
        bad = sum(not k.ok for k in self.kernels)
        symbolic = sum(bool(k.sizes) for k in self.kernels)
        out.append(f"{len(self.kernels)} stitched kernels checked on {self.platform}: "
                   f"{len(self.kernels) - bad} ok, {bad} not ok"
                   + (f"; {symbolic} of symbolic shape, each run at its sizes" if symbolic else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def stitched_kernels(mod: tvm.IRModule, target, fusion: str = DEFAULT_FUSION) -> tuple:
    """(stitched module, StitchReport, {kernel name: fused PrimFunc}) for `target`, as the pipeline makes them
    (grouped by `fusion`, as `pipeline`'s)."""
    fused = {}
    model = cost_model.SHIPPED.get("cuda")

    def choose(func, rule, spec, prices):
        fused.setdefault(rule.kernel, func)  # the group's own PrimFunc: size variants choose at static sizes after it
        return (cost_model.choose(model, func, rule, spec) if model is not None
                else choose_in_time(func, rule, spec, prices))

    report = StitchReport()
    with target:
        grouped = tvm.transform.Sequential(grouping_passes(target))(tvm.IRModule(mod.functions, attrs=mod.attrs))
        out = stitch_module(grouped, target, report=report, choose=choose, fusion=fusion)
    return out, report, fused


def _references(func: tirx.PrimFunc, name: str, fused: dict, packs: dict) -> list:
    attrs = func.attrs
    if "tvm_stitch.plan" in attrs:
        member = fused[StitchPlan.from_json(str(attrs["tvm_stitch.plan"])).kernel]
        return [Reference(member, tuple(range(len(member.params))))]
    members = [fused[m] for m in packs[name]]
    n_in = sum(len(m.params) - len(written_params(m)) for m in members)
    refs, next_in, next_out = [], 0, n_in
    for member in members:
        n_out = len(written_params(member))
        count = len(member.params) - n_out
        refs.append(Reference(member, tuple(range(next_in, next_in + count)) +
                              tuple(range(next_out, next_out + n_out))))
        next_in += count
        next_out += n_out
    return refs


def check(mod: tvm.IRModule, target=None, *, oclgrind: bool = False, seed: int = 0,
          sizes: dict | None = None, fusion: str = DEFAULT_FUSION) -> SimtReport:
    """Run every stitched CUDA kernel of `mod` with SIMT semantics; see the module docstring.

    `target`: the CUDA target the kernels are planned for (default sm_90).
    `oclgrind=True` runs on the Oclgrind simulator (slow: small shapes).
    `sizes`: symbolic variable name -> the values its kernels run at
    (default: from the recorded bounds, see symbolic_sizes). `fusion`: the grouping, as `pipeline`'s.
    """
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"simt.check expects a Relax IRModule, got {type(mod).__name__}")
    target = as_target(target if target is not None else dict(DEFAULT_TARGET))
    if target.kind.name != "cuda":
        raise ValueError(f"simt.check runs CUDA kernels; target kind {target.kind.name!r} is not cuda")
    device = opencl_run.device_for(oclgrind)
    stitched, report, fused = stitched_kernels(mod, target, fusion)
    packs = {packed: members for packed, members in report.packs}
    result = SimtReport(stitch=report, platform=device.platform.name)
    lower, upper = recorded_bounds(mod)
    for gv, func in stitched.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
            continue
        if "tvm_stitch.plan" not in func.attrs and "tvm_stitch.packed" not in func.attrs:
            continue
        refs = _references(func, gv.name_hint, fused, packs)
        if len(refs) == 1:
            func = last_block_combining(func, refs[0].func, target)
        try:
            points = size_points(func, lower, upper, dict(sizes or {}))
        except ValueError as err:
            result.kernels.append(KernelCheck(gv.name_hint, "unsupported", float("nan"), f"no sizes to check: {err}"))
            continue
        kernel = (_check_variants(gv.name_hint, func, refs, device, oclgrind, seed, points)
                  if VARIANTS in func.attrs else check_kernel(gv.name_hint, func, refs, device, oclgrind, seed, points))
        if oclgrind and oclgrind_fit.over_resources(kernel.status, kernel.detail):
            kernel = _within_device(gv.name_hint, refs, report.spec, target, device, seed, points) or kernel
        result.kernels.append(kernel)
    return result


def _check_variants(name: str, func: tirx.PrimFunc, refs: list, device, oclgrind: bool, seed: int,
                    points: list) -> KernelCheck:
    """The KernelCheck of a kernel choosing among size variants: at each point, the variant that
    runs there (kernels/variants.branch_at), built and run on its own; the first failure, else the
    check of the last point."""
    checks = [check_kernel(name, branch_at(func, point), refs, device, oclgrind, seed, [{}]) for point in points]
    bad = [c for c in checks if not c.ok]
    sizes = tuple(describe(p) for p in points)
    first = bad[0] if bad else checks[-1]
    return dataclasses.replace(first, detail=f"size variants, each run where it is chosen ({'; '.join(sizes)}): "
                               f"{first.detail}", sizes=sizes)


def _within_device(name: str, refs: list, spec, target, device, seed: int, points: list):
    """The KernelCheck of the kernel's members (its fused PrimFuncs) planned within `device`'s
    resources (simt/oclgrind_fit), or None where no such plan runs."""
    checks = []
    for k, ref in enumerate(refs):
        member = None
        for fitted in oclgrind_fit.fitting_specs(spec, device):
            try:
                scheduled, plan = oclgrind_fit.replanned(ref.func, f"{name}_{k}", fitted, target)
            except Exception:  # noqa: BLE001 - no plan for this limit: try the next one
                continue
            own = Reference(ref.func, tuple(range(len(ref.func.params))))
            member = check_kernel(name, scheduled, [own], device, True, seed, points)
            if not oclgrind_fit.over_resources(member.status, member.detail):
                member = dataclasses.replace(
                    member, detail=f"{member.detail}; {oclgrind_fit.describe(fitted, plan)}")
                break
        if member is None or oclgrind_fit.over_resources(member.status, member.detail):
            return None
        checks.append(member)
    bad = [c for c in checks if not c.ok]
    first = bad[0] if bad else checks[0]
    detail = first.detail if len(checks) == 1 else f"{len(checks)} packed kernels checked apart; {first.detail}"
    return dataclasses.replace(first, detail=detail, launches=sum(c.launches for c in checks))
