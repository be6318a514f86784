"""What a candidate group costs: its kernel planned and priced, memoised per structural signature.

CUDA: modeled microseconds from the kernel's launch geometry and traffic
(docs/time-model.md). CPU: a traffic and launch proxy of the kernel (its
modeled bytes over a per-core streaming rate, plus a launch overhead per
kernel): the learned CPU model ranks one group's configurations, it does not
compare groups. Greedy's groups are priced exactly, as the stitch pass builds
them (`exact`: the plan the time model or cost model chooses, built and
checked); every other candidate by its rule plan, scheduled and priced
without the choice among variants or the build check (`estimate`), which
costs a third as much: the choice only lowers a kernel's modeled time, so a
plan cheaper than greedy's under the estimates is cheaper built. A group
whose plan fails costs None (not a candidate); a single node that fails
keeps TVM's default path and is priced by the same proxy from the bytes it
reads and writes.

Groups of a model's repeated layers are the same PrimFuncs wired the same
way: the signature (the op functions' structural hashes, how they read each
other and what they read from outside, which results leave the group) is
computed before outlining, so a layer's groups are outlined and priced once.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax

from schedules import schedule_for
from tvm_stitch.analysis.size_bounds import with_size_bounds
from tvm_stitch.pricing.modeled_time import plan_times
from tvm_stitch.pricing.price_memo import PriceMemo
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.kernels.outline import outline_group
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us

# The CPU proxy's weights (not hardware facts: a model of the cost, fitted to nothing): bytes a core
# streams per microsecond, and the overhead of one parallel launch.
CPU_PROXY_BYTES_PER_US_PER_CORE = 8e3
CPU_PROXY_LAUNCH_US = 5.0


def proxy_us(spec: TargetSpec, moved_bytes: float, launches: int) -> float:
    """Launch overhead plus bytes at the sustainable bandwidth (CUDA: the spec's; CPU: the proxy's)."""
    if spec.family == "cuda":  # the spec's bandwidth is the sustainable one already (spec.time_constants)
        return launches * spec.launch_us + moved_bytes / spec.hbm_bytes_per_us
    return launches * CPU_PROXY_LAUNCH_US + moved_bytes / (max(1, spec.cores) * CPU_PROXY_BYTES_PER_US_PER_CORE)


def tensor_bytes(ty) -> int:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return 0
    total = max(1, tvm.DataType(str(ty.dtype)).bits // 8)
    for dim in ty.shape.values:
        if not isinstance(dim, tvm.tirx.IntImm):
            return 0
        total *= int(dim)
    return total


def _type_of(graph, ref):
    return getattr(graph.externals[ref.output], "ty", None) if ref.op < 0 else graph.ops[ref.op].out_types[ref.output]


def fallback_us(graph, node: int, spec: TargetSpec) -> float:
    """A node left to TVM's default path: one launch reading its inputs and writing its results."""
    ops = set(graph.nodes[node].ops)
    inputs = {ref for i in ops for ref in graph.ops[i].inputs if ref.op not in ops}
    moved = sum(tensor_bytes(_type_of(graph, ref)) for ref in inputs)
    moved += sum(tensor_bytes(ty) for i in ops for ty in graph.ops[i].out_types)
    return proxy_us(spec, moved, 1)


class Pricer:
    """cost(owned, recomputed) of a block's candidate groups. `attempt(owned, recomputed)` builds one
    (the stitch pass's attempt: a stitched one has its kernel's plan); `estimate(owned, recomputed)`
    plans one: its rule plan with `modeled_us` (CUDA) or `modeled_bytes` (CPU), None where it fails."""

    def __init__(self, graph, spec: TargetSpec, attempt, estimate, escaping: frozenset):
        self.graph = graph
        self.spec = spec
        self.attempt = attempt
        self.estimate = estimate
        self.escaping = escaping  # nodes whose result later code or an opaque binding reads
        self.memo: dict = {}
        self.hashes: dict = {}
        self.consumers = graph.consumers
        self.unpriced = False  # a stitched kernel without a modeled cost was met

    def _hash(self, op) -> int:
        if op.gv.name_hint not in self.hashes:
            self.hashes[op.gv.name_hint] = tvm_ffi.structural_hash(op.func)
        return self.hashes[op.gv.name_hint]

    def signature(self, owned: frozenset, recomputed: frozenset) -> tuple:
        inside = sorted(owned | recomputed)
        where = {i: (k, pos) for k, n in enumerate(inside) for pos, i in enumerate(self.graph.nodes[n].ops)}
        outside: dict = {}
        out = []
        for n in inside:
            leaves = n in owned and (n in self.escaping or any(c not in owned for c in self.consumers[n]))
            for i in self.graph.nodes[n].ops:
                op = self.graph.ops[i]
                refs = tuple(("in", where[r.op], r.output) if r.op in where else
                             ("ext", outside.setdefault(r, len(outside)), str(_type_of(self.graph, r)))
                             for r in op.inputs)
                out.append((n in owned, leaves, self._hash(op), refs))
        return tuple(out)

    def cost(self, owned: frozenset, recomputed: frozenset, exact: bool = False) -> tuple:
        """(cost or None, whether the group stitches: a single node that does not is left to TVM)."""
        key = (exact, self.signature(owned, recomputed))
        if key not in self.memo:
            self.memo[key] = self._priced(owned, recomputed, exact)
        return self.memo[key]

    def _priced(self, owned: frozenset, recomputed: frozenset, exact: bool) -> tuple:
        if exact:
            attempt = self.attempt(sorted(owned), sorted(recomputed))
            plan = attempt.kernel.plan if attempt.stitched else None
        else:
            plan = self.estimate(sorted(owned), sorted(recomputed))
        if plan is None:
            if len(owned) == 1 and not recomputed:
                return fallback_us(self.graph, next(iter(owned)), self.spec), False
            return None, False
        us = plan_cost(plan, self.spec)
        self.unpriced |= us is None
        return us, True


def plan_cost(plan, spec: TargetSpec) -> float | None:
    """A kernel's price: its modeled time (CUDA) or the proxy of its modeled bytes and launches (CPU);
    None where it has neither (symbolic sizes without bounds)."""
    if spec.family == "cuda":
        return plan.modeled_us if plan.modeled_us >= 0 else None
    return proxy_us(spec, plan.modeled_bytes, plan.kernels) if plan.modeled_bytes >= 0 else None


def estimated_plan(mod, graph, owned: list, recomputed: list, bounds: dict, spec: TargetSpec, target,
                   memo: PriceMemo | None = None):
    """The rule plan of a group with its modeled cost (see the module docstring); None where the group
    does not outline, plan or schedule. `memo`: the module's prices (a kernel priced before is not
    priced again)."""
    memo = memo if memo is not None else PriceMemo()
    try:
        outlined = outline_group(mod, graph, owned, "priced", recomputed)
        fused = with_size_bounds(outlined.func, outlined.args, bounds)
        plan = plan_kernel(fused, spec, "priced")
        if spec.family == "cuda":
            times = memo.times(fused, plan, lambda: plan_times(fused, plan, spec))
            return dataclasses.replace(plan, modeled_us=total_us(times)) if times else None
        traffic = modeled_traffic(schedule_for(fused, plan, target).mod["main"], spec)
    except Exception:  # noqa: BLE001 - a group that does not plan is no candidate
        return None
    return dataclasses.replace(plan, modeled_bytes=traffic.total) if traffic is not None else None
