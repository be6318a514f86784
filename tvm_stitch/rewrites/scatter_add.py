"""ScatterAddsAtomically: each accumulating `scatter_nd` of a CUDA module becomes a planned kernel with
atomic adds (planning/scatter_add.py, schedules/cuda/scatter_add.py), before LegalizeOps.

`scatter_nd(data, indices, updates, "add")` (an embedding's gradient, as the
torch importer writes `index_put(..., accumulate=True)`) is replaced by
`call_tir(scatter_add, [(data,) indices, updates])`. Where data is a
`full` of a constant (the zeros of a gradient) the kernel writes the
constant itself and the `full` binding is dropped; otherwise it copies data.
The kernel is already scheduled and opaque to FuseOps; a symbolic count of
index tuples stays symbolic in it, priced at its upper bound. A scatter that
cannot be planned (another reduction, a dtype the arch does not add
atomically, a symbolic output shape) or whose kernel
does not build keeps TVM's lowering, with the reason in the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from schedules.cuda import scatter_add as cuda_scatter_add
from tvm_stitch.analysis.shape_dims import dims
from tvm_stitch.analysis.size_bounds import at_sizes, function_bounds
from tvm_stitch.kernels.builds import check_builds
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.analysis.op_patterns import OPAQUE
from tvm_stitch.rewrites.rebind import rebound
from tvm_stitch.planning.reasons import PlanError, Reason, reason_of
from tvm_stitch.planning.scatter_add import ScatterAddPlan, plan_scatter_add
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us
from tvm_stitch.stitch_target import StitchTarget


@dataclass(frozen=True)
class ScatterRecord:
    """One accumulating scatter and what became of it."""

    function: str
    binding: str
    plan: ScatterAddPlan | None = None
    modeled_us: float = -1.0
    reason: Reason | None = None

    def line(self) -> str:
        where = f"{self.function}: [{self.binding}]"
        if self.plan is None:
            return f"scatter-add fallback {where}: {self.reason.text}"
        loaded, stored, ideal = self.plan.traffic()
        us = f", {self.modeled_us:.1f} us" if self.modeled_us >= 0 else ""
        return (f"scatter-add {where}: {self.plan.describe()}; modeled {(loaded + stored) / 1e6:.2f} MB "
                f"(ideal {ideal / 1e6:.2f}){us}")


def constant_fill(func: relax.Function, data: relax.Expr) -> float | None:
    """The constant `data` is made of where it is bound to `full(shape, constant)` or `zeros` in
    `func`, else None."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}
    value = bound.get(data) if isinstance(data, relax.Var) else data
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    if value.op.name == "relax.zeros":
        return 0.0
    if value.op.name == "relax.full" and isinstance(value.args[1], tvm.ir.Constant):
        fill = value.args[1].value.numpy()
        return float(fill) if np.ndim(fill) == 0 else None
    return None


def _plan(function: relax.Function, call: relax.Call, spec: TargetSpec) -> ScatterAddPlan:
    reduction = str(call.attrs.reduction)
    if reduction != "add":
        raise PlanError("scatter-reduction", reduction=reduction)
    data, indices, updates = call.args
    return plan_scatter_add(dims(data), dims(indices), dims(updates), str(data.ty.dtype), str(indices.ty.dtype),
                            constant_fill(function, data), spec, function_bounds(function))


@tvm.transform.module_pass(opt_level=0, name="ScatterAddsAtomically")
class ScatterAddsAtomically:
    """Accumulating scatters -> one planned kernel each (module docstring). `report`: a StitchReport (its
    `scatters` list receives a ScatterRecord per scatter_nd); `spec`: the TargetSpec to plan for (default:
    the target's)."""

    def __init__(self, target, report=None):
        made = StitchTarget.of(target)
        self.target, self.spec, self.report = made.target, made.kernel_spec, report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        spec = self.spec
        builder = relax.BlockBuilder(tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs))
        replaced, records = {}, []
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            for binding in (b for block in func.body.blocks for b in block.bindings):
                value = binding.value if isinstance(binding, relax.VarBinding) else None
                if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.scatter_nd":
                    record, kernel = self._planned(gv.name_hint, func, binding, spec)
                    records.append(record)
                    if kernel is not None:
                        replaced[binding.var] = (record.plan, builder.add_func(kernel, "scatter_add"))
        out = rebound(builder, replaced, _kernel_call) if replaced else mod
        if self.report is not None:
            self.report.scatters.extend(records)
        return out

    def _planned(self, function: str, func: relax.Function, binding, spec: TargetSpec) -> tuple:
        name = str(binding.var.name)
        try:
            plan = _plan(func, binding.value, spec)
            kernel = cuda_scatter_add.build(plan).with_attrs(
                {"op_pattern": OPAQUE, "tvm_stitch.scatter_add": plan.describe(),
                 "tvm_stitch.traffic": list(plan.traffic())})
            check_builds(kernel, self.target)
        except Exception as err:  # noqa: BLE001 - a scatter that is not planned or built keeps TVM's path
            return ScatterRecord(function, name, reason=reason_of(err)), None
        priced = at_sizes(kernel, dict(plan.priced_at)) if plan.priced_at else kernel
        times = modeled_times(priced, spec, name="scatter_add")
        return ScatterRecord(function, name, plan, total_us(times) if times else -1.0), kernel


def _kernel_call(mutator, binding: relax.VarBinding, entry: tuple) -> relax.Expr:
    """The call of a scatter's kernel: (data,) indices, updates."""
    plan, gv = entry
    data, indices, updates = (mutator.visit_expr(a) for a in binding.value.args)
    args = ([data] if plan.init == "copy" else []) + [indices, updates]
    return relax.call_tir(gv, relax.Tuple(args), relax.TensorType(plan.out_shape, plan.dtype))
