"""What a candidate group costs: its kernel built and priced, memoised per structural signature.

CUDA: the modeled microseconds of the kernel the stitch pass would build for
the group (its plan chosen by the time model, scheduled, priced from its
launch geometry and traffic: docs/time-model.md). CPU: a traffic and launch
proxy of the built kernel (its modeled bytes over a per-core streaming rate,
plus a launch overhead per kernel): the learned CPU model ranks one group's
configurations, it does not compare groups. A group whose plan fails costs
None (not a candidate); a single node that fails keeps TVM's default path
and is priced by the same proxy from the bytes it reads and writes.

Groups of a model's repeated layers are the same PrimFuncs wired the same
way: the signature (the op functions' structural hashes, how they read each
other and what they read from outside, which results leave the group) is
computed before outlining, so a layer's groups are outlined and priced once.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from tvm_stitch.planning.spec import CUDA_ACHIEVABLE_BANDWIDTH, TargetSpec

# The CPU proxy's weights (not hardware facts: a model of the cost, fitted to nothing): bytes a core
# streams per microsecond, and the overhead of one parallel launch.
CPU_PROXY_BYTES_PER_US_PER_CORE = 8e3
CPU_PROXY_LAUNCH_US = 5.0


def proxy_us(spec: TargetSpec, moved_bytes: float, launches: int) -> float:
    """Launch overhead plus bytes at the sustainable bandwidth (CUDA: the spec's; CPU: the proxy's)."""
    if spec.family == "cuda":
        return launches * spec.launch_us + moved_bytes / (spec.hbm_bytes_per_us * CUDA_ACHIEVABLE_BANDWIDTH)
    return launches * CPU_PROXY_LAUNCH_US + moved_bytes / (max(1, spec.cores) * CPU_PROXY_BYTES_PER_US_PER_CORE)


def _bytes(ty) -> int:
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
    moved = sum(_bytes(_type_of(graph, ref)) for ref in inputs)
    moved += sum(_bytes(ty) for i in ops for ty in graph.ops[i].out_types)
    return proxy_us(spec, moved, 1)


class Pricer:
    """cost(owned, recomputed) of a block's candidate groups; `attempt(owned, recomputed)` builds one
    (the stitch pass's attempt: a stitched one has its kernel's plan)."""

    def __init__(self, graph, spec: TargetSpec, attempt, escaping: frozenset):
        self.graph = graph
        self.spec = spec
        self.attempt = attempt
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

    def cost(self, owned: frozenset, recomputed: frozenset) -> tuple:
        """(cost or None, whether the group stitches: a single node that does not is left to TVM)."""
        key = self.signature(owned, recomputed)
        if key not in self.memo:
            self.memo[key] = self._priced(owned, recomputed)
        return self.memo[key]

    def _priced(self, owned: frozenset, recomputed: frozenset) -> tuple:
        attempt = self.attempt(sorted(owned), sorted(recomputed))
        if not attempt.stitched:
            if len(owned) == 1 and not recomputed:
                return fallback_us(self.graph, next(iter(owned)), self.spec), False
            return None, False
        plan = attempt.kernel.plan
        if self.spec.family == "cuda" and plan.modeled_us >= 0:
            return plan.modeled_us, True
        if self.spec.family != "cuda" and plan.modeled_bytes >= 0:
            return proxy_us(self.spec, plan.modeled_bytes, plan.kernels), True
        self.unpriced = True
        return None, True
