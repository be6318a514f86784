"""FuseAttention: each attention chain of the Relax graph becomes one kernel (a call_tir of a PrimFunc
built from its plan), before LegalizeOps.

The chain (analysis/attention_chain.py: Q K^T, scale, additive or causal
mask, softmax, P V) is replaced by `call_tir(fused_attention, [q, k, v,
(mask), (rotary tables)])`, where q, k and v are the tensors Q, K and V are
made from (the kernel reads them in place through the views' index maps and
applies a rotary embedding while staging); the views of its output stay
Relax views, the bindings it no longer reads are dropped. The kernel is
planned for the target's TargetSpec (planning/attention.py) and built by
schedules/cuda/attention.py or schedules/cpu/attention.py, already scheduled (`tirx.is_scheduled`) and
opaque to FuseOps (`op_pattern` 8), so TVM's rules and the stitch pass
leave it as it is. A mask computed from constants alone (a decoder's causal
mask, before FoldConstant has run on llvm) is evaluated on the host to tell
a causal mask, which the kernel computes from the indices, from one it
reads. Where a chain cannot be planned or its kernel does not build, the
chain stays as it was (TVM's path) with the reason in the report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from schedules.cpu import attention as cpu_attention
from schedules.cuda import attention as cuda_attention
from schedules.cuda import attention_mma
from tvm_stitch.analysis.attention_chain import AttentionChain, find_chains, mask_kind
from tvm_stitch.analysis.shape_dims import dims, priced_sizes, sizes_in, static
from tvm_stitch.analysis.size_bounds import function_bounds
from tvm_stitch.rewrites.attention_mask import symbolic_mask_kind
from tvm_stitch.rewrites.attention_tables import with_constant_tables
from tvm_stitch.rewrites.rebind import rebound
from tvm_stitch.kernels.builds import check_builds
from tvm_stitch.rewrites.host_constants import evaluate_bindings
from tvm_stitch.analysis.op_patterns import OPAQUE
from tvm_stitch.planning.attention import AttentionPlan, AttentionShape, plan_attention
from tvm_stitch.planning.attention_cost import modeled_us, traffic
from tvm_stitch.pricing.attention_default import default_floor_us, default_us
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.planning.reasons import PlanError, Reason
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.stitch_target import StitchTarget

@dataclass(frozen=True)
class AttentionRecord:
    """One chain (or softmax that looked like one) and what became of it."""

    function: str
    bindings: tuple
    plan: AttentionPlan | None = None
    kernel: str = ""
    reason: Reason | None = None
    default_us: float = -1.0  # TVM's default path for the chain, modeled (CUDA; -1: not priced)
    default_floor: bool = False  # default_us is the default path's floor (the fused kernel is faster than it)

    @property
    def fused(self) -> bool:
        """Whether the chain became one kernel (else it kept TVM's path, `reason` saying why)."""
        return self.plan is not None

    def line(self) -> str:
        where = f"{self.function}: [{','.join(self.bindings)}]"
        if self.plan is not None:
            loaded, stored, ideal = traffic(self.plan)
            us = modeled_us(self.plan)
            cost = f"; modeled {(loaded + stored) / 1e6:.2f} MB (ideal {ideal / 1e6:.2f})" + (
                f", {us:.1f} us" if us >= 0 else "") + (
                f" (TVM's default path {'at least ' if self.default_floor else ''}{self.default_us:.1f} us)"
                if self.default_us >= 0 else "")
            return f"attention {self.kernel} {where}: {self.plan.describe()}{cost}"
        return f"attention fallback {where}: {self.reason.text}"


def shape_of(chain: AttentionChain, bounds: dict | None = None) -> AttentionShape:
    """The chain's AttentionShape; symbolic sizes planned at their upper bounds in `bounds` ({name:
    (lower, upper or None)}, the Relax function's)."""
    q, k = (_four(e) for e in (chain.q, chain.k))
    mask = _four(chain.mask) if chain.mask is not None else ()
    shapes = [q, k, mask] + [s for view in chain.views for s in (view.source, view.cos, view.sin)]
    return AttentionShape(batch=q[0], heads=q[1], kv_heads=k[1], q_len=q[2], kv_len=k[2], head_dim=q[3],
                          dtype=str(chain.q.ty.dtype), scale=chain.scale, mask=chain.mask_kind, mask_shape=mask,
                          mask_dtype=str(chain.mask.ty.dtype) if chain.mask is not None else "",
                          operands=chain.views, priced_at=priced_sizes(sizes_in(shapes), bounds or {}))


def _four(expr) -> tuple:
    shape = dims(expr)
    return (1,) * (4 - len(shape)) + shape


def kernel_for(plan: AttentionPlan):
    if plan.mma:
        return attention_mma.build(plan)
    return (cuda_attention if plan.spec.family == "cuda" else cpu_attention).build(plan)


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Attention chains -> one planned kernel each (module docstring). `target`: a StitchTarget (or a
    target one is made from), planned for its `kernel_spec`; `report`: a StitchReport (its `attention`
    list receives an AttentionRecord per chain); `fast_math`: CPU kernels take exp as a vectorisable
    polynomial (the pipeline's option; default on, as the pipeline's on llvm)."""

    def __init__(self, target, report=None, fast_math: bool = True):
        made = StitchTarget.of(target)
        self.target, self.spec, self.report, self.fast_math = made.target, made.kernel_spec, report, fast_math
        self.default_prices = {}  # TVM's default path per priced chain shape, modeled (this pass's chains)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        spec = self.spec
        builder = relax.BlockBuilder(tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs))
        replaced, records = {}, []
        for gv, func in mod.functions_items():
            chains, others = find_chains(func)
            bounds = function_bounds(func) if isinstance(func, relax.Function) else {}
            records += [AttentionRecord(gv.name_hint, (o.binding,), reason=Reason(o.code, o.params)) for o in others]
            chains = [with_constant_tables(func, _with_evaluated_mask(func, c)) for c in chains]
            for chain in chains:
                record, kernel = self._planned(gv.name_hint, chain, spec, bounds)
                records.append(record)
                if kernel is not None:
                    replaced[chain.output] = (chain, builder.add_func(kernel, record.kernel))
        out = rebound(builder, replaced, _kernel_call) if replaced else mod
        if self.report is not None:
            self.report.attention.extend(records)
        return out

    def _planned(self, function: str, chain: AttentionChain, spec: TargetSpec, bounds: dict) -> tuple:
        try:
            plan = plan_attention(shape_of(chain, bounds), spec, fast_exp=self.fast_math)
            kernel = kernel_for(plan).with_attrs({"op_pattern": OPAQUE, "tvm_stitch.attention": plan.describe(),
                                                  "tvm_stitch.traffic": list(traffic(plan))})
            check_builds(kernel, self.target)
            default, floor = self._default_faster(plan, kernel)
        except PlanError as err:
            return AttentionRecord(function, chain.bindings, reason=err.reason), None
        except Exception as err:  # noqa: BLE001 - a kernel that does not build leaves TVM's path
            lines = str(err).strip().splitlines()
            reason = Reason("error", {"type": type(err).__name__, "message": lines[-1][:200] if lines else ""})
            return AttentionRecord(function, chain.bindings, reason=reason), None
        return AttentionRecord(function, chain.bindings, plan, kernel="fused_attention", default_us=default,
                               default_floor=floor), kernel

    def _default_faster(self, plan: AttentionPlan, kernel: tirx.PrimFunc) -> tuple:
        """(TVM's default path for the chain modeled, or its floor where the fused kernel is faster than that;
        -1 off CUDA, whether it is the floor); PlanError where the default is modeled faster than the fused
        kernel. Both are priced alike: every kernel from its lowered TIR (modeled_time), as a whole module is
        priced (tools/module_time, explain); the plan's own price (attention_cost) for a kernel of symbolic
        sizes (the default is priced at the plan's sizes) or whose TIR cannot be priced."""
        if modeled_us(plan) < 0:
            return -1.0, False
        times = None if plan.shape.priced_at else modeled_times(kernel, self.spec)
        fused = sum(t.us for t in times) if times else modeled_us(plan)
        floor = default_floor_us(plan.shape, self.spec)
        if fused < floor:
            return floor, True
        s = plan.shape.priced()
        key = (s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.dtype, s.mask)
        if key not in self.default_prices:
            self.default_prices[key] = default_us(plan.shape, self.target, self.spec)
        default = self.default_prices[key]
        if 0 <= default < fused:
            raise PlanError("attention-default-faster", default_us=round(default, 1), fused_us=round(fused, 1))
        return default, False


def _with_evaluated_mask(func: relax.Function, chain: AttentionChain) -> AttentionChain:
    """`chain`, its mask kind decided from the mask's value where the mask depends on constants alone
    (and on symbolic sizes: proved from its closed form, rewrites/attention_mask.py)."""
    if chain.mask is None or not isinstance(chain.mask, relax.Var):
        return chain
    bindings = constant_slice(func, chain.mask)
    if bindings is None:
        return chain
    q_len, kv_len = _four(chain.q)[2], _four(chain.k)[2]
    if not static(dims(chain.mask)) or any(relax.analysis.free_symbolic_vars(b.value) for b in bindings):
        kind = symbolic_mask_kind(func, chain.mask, q_len, kv_len)
    else:
        value = evaluate_bindings(bindings, [chain.mask])[0]
        kind = mask_kind(relax.const(np.asarray(value), str(chain.mask.ty.dtype)), q_len, kv_len)
    if kind == "additive":
        return chain
    return dataclasses.replace(chain, mask=None, mask_kind=kind)


def constant_slice(func: relax.Function, var: relax.Var) -> list | None:
    """The bindings (in order) that compute `var` from constants (and the function's symbolic sizes)
    alone: Relax operators over constants (bound to vars or not), no parameter, no call of a function;
    None where `var` needs anything else."""
    bound = {b.var: b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}
    sizes = set(relax.analysis.defined_symbolic_vars(func))
    needed, stack = set(), [var]
    while stack:
        v = stack.pop()
        if v in needed or v in sizes:
            continue
        binding = bound.get(v)
        value = binding.value if binding is not None else None
        if value is None or (isinstance(value, relax.Call) and not _evaluable(value.op)):
            return None
        needed.add(v)
        stack.extend(relax.analysis.free_vars(value))
    return [b for b in bound.values() if b.var in needed]


def _evaluable(op) -> bool:
    """A Relax operator the host evaluates alone (not a call of a function, packed or printing op)."""
    return (isinstance(op, tvm.ir.Op) and op.name.startswith("relax.")
            and not op.name.startswith(("relax.call", "relax.print", "relax.assert", "relax.random")))


def _kernel_call(mutator, binding: relax.VarBinding, entry: tuple) -> relax.Expr:
    """The call of a chain's kernel (reshaped to the output var's rank), which reads Q, K and V from the
    tensors they are views of."""
    chain, gv = entry
    args = [mutator.visit_expr(e) for e in chain.sources]
    if chain.mask is not None:
        args.append(_as_four(mutator, mutator.visit_expr(chain.mask)))
    args += [mutator.visit_expr(t) for t in chain.tables]
    out = relax.call_tir(gv, relax.Tuple(args), relax.TensorType(_four(chain.q), chain.q.ty.dtype))
    shape = binding.var.ty.shape
    return out if len(shape.values) == 4 else relax.op.reshape(mutator.builder_.emit(out), shape)


def _as_four(mutator, expr):
    dims = list(expr.ty.shape.values)
    if len(dims) == 4:
        return expr
    return mutator.builder_.emit(relax.op.reshape(expr, [1] * (4 - len(dims)) + dims))
