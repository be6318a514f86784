"""StitchFusion: the Relax pass that stitches memory-bound groups into scheduled kernels.

Runs after FuseOps. Per dataflow block: build the graph, partition it into
convex memory-bound groups, and for each group outline -> FuseTIR -> plan ->
schedule, everything for the StitchTarget made once (stitch_target.py). Each
stage returns a value, and each group's try is an `Attempt`: scheduled (a
`Kernel`), or a fallback with the stage it stopped after and its `Reason`.
A group that succeeds becomes one `call_tir` of a scheduled PrimFunc
(attribute `tirx.is_scheduled`, so dlight leaves it alone, and
`tvm_stitch.plan` holding its plan); one that fails keeps its original
bindings — TVM's default path. A group retried (in parts, or without the
producers it recomputes) leaves a note instead of its attempt. Finally,
independent barrier-free kernels of a block share launches (packing.py).
The report is made from the attempts, notes and packs at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax
from tvm.target import Target

from schedules import schedule_for
from tvm_stitch.analysis.graph import Graph, analyses_for, build_graph
from tvm_stitch.analysis.size_bounds import at_upper_bounds, function_bounds, with_size_bounds
from tvm_stitch.kernels.builds import check_builds
from tvm_stitch.pricing.modeled_time import plan_us, scheduled_us
from tvm_stitch.pricing.plan_prices import PlanPrices
from tvm_stitch.pricing.timed_choice import choose_in_time
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.grouping.group_pricing import estimated_plan, plan_cost
from tvm_stitch.grouping.fusion_search import SEARCH_SECONDS, greedy_groups, greedy_price, search_block, settled
from tvm_stitch.kernels.outline import Outlined, outline_group
from tvm_stitch.grouping.unfuse import opened_block
from tvm_stitch.kernels.packing import pack_block, pack_groups, packable
from tvm_stitch.kernels.timed_packing import pack_in_time, walk_in_time
from tvm_stitch.grouping.partition import partition, recomputed_in, recomputed_producers
from tvm_stitch.kernels.cpu_variants import cpu_row_size, cpu_size_variants
from tvm_stitch.kernels.variants import Planner, dispatching, row_size, size_variants
from tvm_stitch.planning import cost_model as _cost_model
from tvm_stitch.planning.limits import partition_limits
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.reasons import Reason, reason_of
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import GroupRecord, StitchReport
from tvm_stitch.stitch_target import StitchTarget, check_spec, emulated
from tvm_stitch.target import as_target


@tvm.error.register_error
class StitchError(RuntimeError):
    """Raised in strict mode when a group cannot be stitched.

    Registered with TVM so that it keeps its type when it crosses the FFI
    boundary of a pass.
    """


def _used_after(func: relax.Function, block_index: int) -> set:
    """Variables of block `block_index` used by later blocks or the result."""
    used = set(relax.analysis.free_vars(func.body.body))
    for block in func.body.blocks[block_index + 1 :]:
        for binding in block.bindings:
            used.update(relax.analysis.free_vars(binding.value))
    return used


def _saved(packs: list) -> int:
    """Launches that packs save: one fewer than its members, per pack."""
    return sum(len(members) - 1 for members in packs)


def _only_reshapes(graph: Graph, members: list) -> bool:
    ops = [graph.ops[i] for m in members for i in graph.nodes[m].ops]
    return bool(ops) and all(relax.analysis.has_reshape_pattern(op.func) for op in ops)


def _defined(node) -> list:
    return [node.var] + [a.var for a in node.aliases]


def _still_read(graph: Graph, recomputed: frozenset, stitched: list) -> frozenset:
    """The recomputed producers read from memory — by a node outside the `stitched` groups (attempts;
    a group that fell back, a reshape left to TVM) or by a group stitched without its copies —
    directly or through each other: they are computed once, in memory."""
    inside = {m for attempt in stitched for m in attempt.group.members}
    read = {p for node in graph.nodes if node.index not in inside and node.index not in recomputed
            for p in graph.producers[node.index] if p in recomputed}
    args = {arg for attempt in stitched for arg in attempt.outlined.args if isinstance(arg, relax.Var)}
    read.update(p for p in recomputed if any(v in args for v in _defined(graph.nodes[p])))
    stack = list(read)
    while stack:
        for p in graph.producers[stack.pop()]:
            if p in recomputed and p not in read:
                read.add(p)
                stack.append(p)
    return frozenset(read)


def _without_unused(bindings: list, droppable: set, used_after: set) -> list:
    """`bindings` less those defining a variable of `droppable` that nothing later reads (a recomputed
    producer every reader of which computes it again)."""
    used = set(used_after)
    kept = []
    for binding in reversed(bindings):
        if binding.var in droppable and binding.var not in used:
            continue
        kept.append(binding)
        used.update(relax.analysis.free_vars(binding.value))
    return kept[::-1]


def _topological_units(graph: Graph, groups: list) -> list:
    """Emission order: each unit is a stitched group or a single node."""
    unit_of = {}
    units = []
    for members in groups:
        for m in members:
            unit_of[m] = len(units)
        units.append(members)
    for node in graph.nodes:
        if node.index not in unit_of:
            unit_of[node.index] = len(units)
            units.append([node.index])
    deps = [set() for _ in units]
    for node in graph.nodes:
        for prod in graph.producers[node.index]:
            if unit_of[prod] != unit_of[node.index]:
                deps[unit_of[node.index]].add(unit_of[prod])
    order = []
    ready = sorted((min(units[u]), u) for u in range(len(units)) if not deps[u])
    waiting = {u: set(d) for u, d in enumerate(deps) if d}
    users = [set() for _ in units]
    for u, d in enumerate(deps):
        for p in d:
            users[p].add(u)
    heapq.heapify(ready)
    while ready:
        _, u = heapq.heappop(ready)
        order.append(units[u])
        for v in users[u]:
            waiting[v].discard(u)
            if not waiting[v]:
                del waiting[v]
                heapq.heappush(ready, (min(units[v]), v))
    if len(order) != len(units):
        raise StitchError("internal error: grouping created a cycle")
    return order


def _modeled_traffic(scheduled: tvm.tirx.PrimFunc, spec: TargetSpec) -> tuple:
    """(modeled traffic or None, note): of symbolic sizes, at their upper bounds where all have one."""
    traffic = modeled_traffic(scheduled, spec)
    if traffic is not None:
        return traffic, ""
    at_bounds, values = at_upper_bounds(scheduled)
    traffic = modeled_traffic(at_bounds, spec) if at_bounds is not None else None
    if traffic is None:
        return None, ""
    sizes = ", ".join(f"{name} = {value}" for name, value in sorted(values.items()))
    return traffic, f"modeled traffic at the upper bounds of the symbolic sizes ({sizes})"


@dataclass(frozen=True)
class Group:
    """A group of bindings the partition chose, as the report names it."""

    function: str  # the Relax function holding the group
    members: tuple  # graph node indices
    bindings: tuple  # names of the Relax variables the group computes
    positions: tuple  # (dataflow block index, binding index) of each binding
    ops: tuple  # names of the legalized operators in the group
    op_kinds: tuple  # their classification
    recomputed: tuple  # graph nodes of the producers the kernel computes again
    recomputed_ops: tuple  # their operators


@dataclass(frozen=True)
class Kernel:
    """A scheduled stitched PrimFunc and its plan."""

    name: str
    plan: StitchPlan
    func: tvm.tirx.PrimFunc  # scheduled, with its plan attached
    notes: tuple = ()  # what the report says of how it was made
    variants: tuple = ()  # planning.variants.Variant chosen at run time before `plan` (kernels/variants.py)


OUTLINED, PLANNED, SCHEDULED = "outlined", "planned", "scheduled"
FUSION_METHODS = ("greedy", "search")
DEFAULT_FUSION = "search"  # the grouping a pipeline uses unless told otherwise (docs/fusion-search.md)


@dataclass(frozen=True)
class Attempt:
    """One try at stitching a group: `reached` is the last stage that succeeded ("" when outlining
    failed); a scheduled attempt has its `kernel` and `outlined` call, a fallback its `reason`."""

    group: Group
    reached: str
    outlined: Outlined | None = None
    kernel: Kernel | None = None
    reason: Reason | None = None

    @property
    def stitched(self) -> bool:
        return self.kernel is not None

    def record(self, kernels: dict) -> GroupRecord:
        """The report's record; `kernels` (name -> Kernel) may hold a variant that replaced the kernel."""
        g = self.group
        kernel = kernels.get(self.kernel.name, self.kernel) if self.kernel else None
        return GroupRecord(function=g.function, bindings=g.bindings, positions=g.positions, ops=g.ops,
                           op_kinds=g.op_kinds, recomputed=g.recomputed_ops,
                           kernel=kernel.name if kernel else "",
                           plan=kernel.plan if kernel else None, reason=self.reason, stage=self.reached,
                           variants=_variant_pairs(kernel) if kernel else ())


def _variant_pairs(kernel: Kernel) -> tuple:
    """(condition on the sizes, plan) of each variant of `kernel`, the plan for every other size last."""
    if not kernel.variants:
        return ()
    return tuple((v.condition.text(), v.plan) for v in kernel.variants) + (("otherwise", kernel.plan),)


@dataclass
class _Outcome:
    """What the pass has made so far, in order: the report is built from it at the end."""

    attempts: list = field(default_factory=list)  # the final Attempt of every group
    opaque: list = field(default_factory=list)  # (binding, reason) left to TVM's default path
    packs: list = field(default_factory=list)  # (packed kernel, member kernels)
    notes: list = field(default_factory=list)
    searches: list = field(default_factory=list)  # fusion_search.SearchRecord per block

    def mark(self) -> tuple:
        """Where the attempts and notes end now (see rollback)."""
        return len(self.attempts), len(self.notes)

    def rollback(self, mark: tuple) -> None:
        """Forget the attempts and notes recorded since `mark` (a block's greedy build the search replaces)."""
        del self.attempts[mark[0]:], self.notes[mark[1]:]

    def into(self, report: StitchReport, kernels: dict) -> None:
        """Fill `report`; `kernels` (name -> Kernel) are the kernels as finally built."""
        report.groups.extend(a.record(kernels) for a in self.attempts)
        report.opaque.extend(self.opaque)
        report.packs.extend(self.packs)
        report.notes.extend(self.notes)
        report.searches.extend(self.searches)


@dataclass(frozen=True)
class _Block:
    """A dataflow block being rewritten: its graph, where each binding is, its sizes' bounds."""

    function: str
    graph: Graph
    where: dict  # binding variable -> (dataflow block index, binding index)
    bounds: dict  # bounds of the function's symbolic sizes (size_bounds)
    recomputed: frozenset  # producers the groups reading them compute again


def _group(block: _Block, members: list, recomputed: tuple = ()) -> Group:
    graph = block.graph
    nodes = [graph.nodes[m] for m in members]
    return Group(
        function=block.function,
        members=tuple(members),
        bindings=tuple(n.var.name for n in nodes),
        positions=tuple(block.where[n.var] for n in nodes),
        ops=tuple(graph.ops[i].name for n in nodes for i in n.ops),
        op_kinds=tuple(graph.ops[i].cls.describe() for n in nodes for i in n.ops),
        recomputed=tuple(recomputed),
        recomputed_ops=tuple(graph.ops[i].name for m in recomputed for i in graph.nodes[m].ops),
    )


class _Stitcher:
    """The stages of the pass for one module: outline, plan, schedule per group; groups per block."""

    def __init__(self, mod: tvm.IRModule, target: Target, strict: bool, spec: TargetSpec, choose=None,
                 fusion: str = DEFAULT_FUSION):
        self.mod = mod
        self.fusion = fusion  # "greedy": partition.py's groups; "search": fusion_search.py's plan
        self.search_seconds = SEARCH_SECONDS  # the solver's time limit per dataflow block
        self.choose = choose  # (fused, rule plan, spec) -> the plan to use; None: the rule plan
        self.target = target
        self.spec = spec
        self.limits = partition_limits(spec)  # what the partition may group, for every block
        # CUDA: the partition that keeps every row on chip, whose groups are the parts of a split one
        self.on_chip_limits = partition_limits(spec, split_long_rows=False) if spec.family == "cuda" else None
        self.strict = strict
        self.analyses = analyses_for(mod)
        self.kernels: dict = {}  # name -> Kernel
        self.done: dict = {}  # structural hash of a fused PrimFunc -> [(fused, Kernel)]
        self.outcome = _Outcome()
        # name -> Kernel: the thread-per-column plan of a one-launch column-split kernel, which packing
        # may share a launch with others (see _packed_variants)
        self.walks: dict = {}

    # --- the stages of one group

    def attempt(self, block: _Block, members: list, recomputed: tuple = ()) -> Attempt:
        """Outline, plan and schedule a group (identical groups share one kernel); a fallback attempt
        with the reason where a stage fails."""
        group = _group(block, members, recomputed)
        reached = ""
        try:
            outlined = outline_group(self.mod, block.graph, members, f"stitch_{len(self.kernels)}", recomputed)
            reached = OUTLINED
            fused = with_size_bounds(outlined.func, outlined.args, block.bounds)
            kernel = self._known(fused)
            if kernel is None:
                prices = PlanPrices(self.spec)  # the kernel's plans priced, each code lowered once
                name, rule, plan = self._plan(fused, group.ops, prices)
                reached = PLANNED
                kernel = self._add(fused, self._built(fused, name, rule, plan, prices))
                self._walk_variant(fused, kernel)
        except Exception as err:  # noqa: BLE001 - any failure of a group means: fall back
            reason = reason_of(err)
            if self.strict:
                raise StitchError(f"cannot stitch {list(group.ops)}: {reason.text}") from err
            return Attempt(group, reached, reason=reason)
        return Attempt(group, SCHEDULED, outlined=outlined, kernel=kernel)

    def _known(self, fused: tvm.tirx.PrimFunc) -> Kernel | None:
        """The kernel already made of a fused PrimFunc structurally equal to `fused`, if any."""
        for other, kernel in self.done.get(tvm_ffi.structural_hash(fused), []):
            if tvm_ffi.structural_equal(other, fused):
                return kernel
        return None

    def _plan(self, fused: tvm.tirx.PrimFunc, ops: tuple, prices: PlanPrices) -> tuple:
        """(kernel name, rule plan, the plan to build: the rule plan or the cost model's choice)."""
        name = f"stitch_{len(self.kernels)}_{'_'.join(ops[:3])}"[:60]
        rule = plan_kernel(fused, self.spec, name)
        return name, rule, self._choice(fused, rule, prices) if self.choose is not None else rule

    def _choice(self, fused: tvm.tirx.PrimFunc, rule: StitchPlan, prices: PlanPrices) -> StitchPlan:
        """The cost model's choice; the time model's with `prices`, the kernel's plans priced so far."""
        if self.choose is choose_in_time:
            return choose_in_time(fused, rule, self.spec, prices)
        return self.choose(fused, rule, self.spec)

    def _add(self, fused: tvm.tirx.PrimFunc, kernel: Kernel) -> Kernel:
        self.kernels[kernel.name] = kernel
        self.done.setdefault(tvm_ffi.structural_hash(fused), []).append((fused, kernel))
        self.outcome.notes.extend(kernel.notes)
        return kernel

    def _built(self, fused: tvm.tirx.PrimFunc, name: str, rule: StitchPlan, plan: StitchPlan,
               prices: PlanPrices) -> Kernel:
        """The kernel of `plan` with its size variants where some are built. A kernel that may get
        variants is checked once: the dispatch's build check covers the plan for every size (its
        last branch); without variants it is checked alone, rescheduled as `_scheduled` does
        where it fails."""
        if row_size(fused, plan) is None and cpu_row_size(fused, plan) is None:
            return self._size_variants(fused, self._scheduled(fused, name, rule, plan), prices)
        kernel = self._size_variants(fused, self._scheduled(fused, name, rule, plan, checked=False), prices)
        if kernel.variants:
            return kernel
        try:
            check_builds(kernel.func, self.target)
        except Exception:  # noqa: BLE001 - the check _scheduled makes, and its fallback to the rule plan
            return self._scheduled(fused, name, rule, plan)
        return kernel

    def _scheduled(self, fused: tvm.tirx.PrimFunc, name: str, rule: StitchPlan, plan: StitchPlan,
                   checked: bool = True) -> Kernel:
        """The kernel of `plan` (the rule plan where the cost model's choice does not build), with
        its modeled traffic; `checked`: whether `plan`'s kernel is build-checked here."""
        notes = ()
        try:
            scheduled = self._schedule(fused, plan, checked)
        except Exception as err:  # noqa: BLE001 - the model's choice failed: the rules' plan is the fallback
            if plan is rule:
                raise
            notes = (f"{name}: the cost model's choice did not build ({type(err).__name__}); the rule plan is used",)
            plan, scheduled = rule, self._schedule(fused, rule)
        traffic, note = _modeled_traffic(scheduled, self.spec)
        if note:
            plan = dataclasses.replace(plan, notes=plan.notes + (note,))
        if traffic is not None:
            plan = dataclasses.replace(plan, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        plan = self._priced(fused, scheduled, plan)
        return Kernel(name, plan, scheduled.with_attr("tvm_stitch.plan", plan.to_json()), notes)

    def _priced(self, fused: tvm.tirx.PrimFunc, scheduled: tvm.tirx.PrimFunc, plan: StitchPlan) -> StitchPlan:
        """`plan` with its modeled time (CUDA plans not yet priced)."""
        if self.spec.family != "cuda" or plan.modeled_us >= 0:
            return plan
        return dataclasses.replace(plan, modeled_us=scheduled_us(scheduled, plan, self.spec)
                                   if self.target.kind.name == "cuda" else plan_us(fused, plan, self.spec))

    def _size_variants(self, fused: tvm.tirx.PrimFunc, kernel: Kernel, prices: PlanPrices) -> Kernel:
        """`kernel` choosing at run time among the plans its symbolic row count calls for, where one
        plan does not serve every size best (kernels/variants.py); `prices`: the kernel's plans priced."""
        planner = Planner(rule=lambda static: plan_kernel(static, self.spec, kernel.name, rows_first=False),
                          choose=lambda static, rule: (self._choice(static, rule, prices) if self.choose is not None
                                                       else _priced(static, rule, self.spec)),
                          price=prices.plan_times,
                          priced=prices.scheduled_times,
                          schedule=lambda func, plan: schedule_for(func, plan, self.target).mod["main"],
                          device=self.target.kind.name == "cuda")
        try:
            variants = (size_variants(fused, kernel.plan, kernel.func, planner) if self.spec.family == "cuda"
                        else cpu_size_variants(fused, kernel.plan, planner))
            if not variants:
                return kernel
            func, variants = dispatching(fused, kernel.func, variants, planner)
            func = func.with_attr("tirx.is_scheduled", True)
            check_builds(func, self.target)
        except Exception as err:  # noqa: BLE001 - the variants are an optimisation: the plan for every size stays
            self.outcome.notes.append(f"{kernel.name}: size variants not built ({type(err).__name__}: {err})")
            return kernel
        return dataclasses.replace(kernel, func=func, variants=variants)

    def _walk_variant(self, fused: tvm.tirx.PrimFunc, kernel: Kernel) -> None:
        """Record the thread-per-column plan of a one-launch column-split kernel when it is packable."""
        if kernel.plan.scheme != "column-split" or kernel.plan.kernels != 1:
            return
        try:
            walk = plan_kernel(fused, self.spec, kernel.name, columns=False)
            if not packable(walk):
                return
            scheduled = self._schedule(fused, walk)
        except Exception:  # noqa: BLE001 - no variant: the column-split kernel stays
            return
        traffic, _ = _modeled_traffic(scheduled, self.spec)
        if traffic is not None:
            walk = dataclasses.replace(walk, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        walk = self._priced(fused, scheduled, walk)
        if not walk_in_time(walk, kernel.plan, self.spec):
            return
        self.walks[kernel.name] = Kernel(kernel.name, walk, scheduled.with_attr("tvm_stitch.plan", walk.to_json()))

    def _packed_variants(self, bindings: list) -> dict:
        """name -> (PrimFunc, plan) of the kernels to pack: where packing the thread-per-column plans of
        the column-split kernels saves more launches than packing the column-split kernels (with
        those of their block shape), each column-split kernel that the walks' packs take is replaced
        by its walk: launch counts never rise for the threads gained."""
        kernels = {name: (kernel.func, kernel.plan) for name, kernel in self.kernels.items()}
        trial = {name: (self.walks[name].func, self.walks[name].plan) if name in self.walks else kernel
                 for name, kernel in kernels.items()}
        walk_packs = pack_groups(bindings, trial)
        if _saved(walk_packs) <= _saved(pack_groups(bindings, kernels)):
            return kernels
        packed = {bindings[i].value.args[0].name_hint for members in walk_packs for i in members}
        for name in packed & set(self.walks):
            self.kernels[name] = self.walks.pop(name)
            kernels[name] = (self.kernels[name].func, self.kernels[name].plan)
        return kernels

    def _pack_in_time(self, func: tvm.tirx.PrimFunc, plans: list) -> bool:
        if pack_in_time(func, plans, self.spec):
            return True
        self.outcome.notes.append(f"time model: {', '.join(p.kernel for p in plans)} left unpacked (slower packed)")
        return False

    def _schedule(self, fused: tvm.tirx.PrimFunc, plan: StitchPlan, checked: bool = True) -> tvm.tirx.PrimFunc:
        sch = schedule_for(fused, plan, self.target)
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        if checked:
            check_builds(scheduled, self.target)
        return scheduled

    # --- the groups of one block

    def rewrite_block(self, function: str, block_index: int, block: relax.DataflowBlock, used_after: set,
                      calls: dict, bounds: dict) -> relax.DataflowBlock:
        graph = build_graph(self.mod, block, used_after, self.analyses)
        self.outcome.opaque.extend((node.var.name, node.reason) for node in graph.nodes if not node.stitchable)
        scope = _Block(function, graph, {b.var: (block_index, k) for k, b in enumerate(block.bindings)}, bounds,
                       recomputed_producers(graph, self.limits))
        greedy = partition(graph, self.limits)
        mark = self.outcome.mark()
        stitched = self._stitched_groups(scope, greedy)
        still_read = _still_read(graph, scope.recomputed, stitched)
        for members in partition(graph, self.limits, among=still_read):
            if not _only_reshapes(graph, members):
                stitched += self._kept([self.attempt(scope, members)])
        if self.fusion == "search" and any(node.stitchable for node in graph.nodes):
            left = [n.index for n in graph.nodes if n.stitchable and n.ops and not _only_reshapes(graph, [n.index])
                    and (n.index not in scope.recomputed or n.index in still_read)
                    and not any(n.index in a.group.members for a in stitched)]
            price = greedy_price(graph, self.spec, [a.kernel.plan for a in stitched], left)
            searched = self._searched(scope, block_index, (block, used_after, mark), (greedy, price, stitched))
            if searched is not None:
                stitched, scope = searched
        if not stitched:
            return block
        return relax.DataflowBlock(self._bindings(scope, stitched, used_after, calls))

    def _searched(self, fused: _Block, block_index: int, where: tuple, greedy: tuple) -> tuple | None:
        """(stitched attempts, scope) of the fusion search's plan, over the block with FuseOps' groups of
        stitchable nodes opened (unfuse.py); None where greedy's plan, already built, stands (it cannot
        be beaten: fusion_search.settled; the search found nothing cheaper; or a group of its plan did
        not stitch). `where`: (the block, the variables later code reads, the outcome's mark before
        greedy's build); `greedy`: (greedy's groups of the block, greedy_price of its build, its stitched
        attempts: the kernels of those groups are priced already)."""
        block, used_after, mark = where
        partitioned, price, built = greedy
        record = settled((fused.function, block_index), fused.graph, self.spec,
                         lambda node: _only_reshapes(fused.graph, [node]), price)
        if record is not None:
            self.outcome.searches.append(record)
            return None
        opened, origin = opened_block(self.mod, block, {n.var for n in fused.graph.nodes if n.stitchable})
        graph = build_graph(self.mod, opened, used_after, self.analyses)
        scope = dataclasses.replace(fused, graph=graph, recomputed=frozenset(),
                                    where={b.var: (block_index, k) for k, b in enumerate(opened.bindings)})
        greedy = greedy_groups(fused.graph, self.limits, partitioned, (graph, origin))
        by_members = {a.group.members: a for a in built}
        known = []
        for members in partitioned:
            a = by_members.get(tuple(members))
            same = a is not None and a.group.recomputed == tuple(recomputed_in(fused.graph, members, fused.recomputed))
            known.append(plan_cost(a.kernel.plan, self.spec) if same else None)

        def attempt(owned: list, recomputed: list) -> Attempt:
            try:
                return self.attempt(scope, owned, tuple(recomputed))
            except StitchError as err:  # strict mode: a candidate that fails is no candidate
                return Attempt(_group(scope, owned, tuple(recomputed)), "", reason=reason_of(err))

        def estimate(owned: list, recomputed: list):
            return estimated_plan(self.mod, graph, owned, recomputed, scope.bounds, self.spec, self.target)

        record, plan = search_block((scope.function, block_index), graph, (greedy, tuple(known)), self.spec,
                                    (attempt, estimate),
                                    lambda node: _only_reshapes(graph, [node]), self.search_seconds)
        self.outcome.searches.append(record)
        if plan is None:
            return None
        attempts = [self.attempt(scope, list(owned), recomputed) for owned, recomputed in plan.groups]
        if not all(a.stitched for a in attempts):
            self.outcome.searches[-1] = dataclasses.replace(record, method="greedy", chosen_us=record.greedy_us,
                                                            why="a group of the searched plan did not stitch")
            return None
        self.outcome.rollback(mark)
        self.outcome.notes.extend(note for a in attempts for note in a.kernel.notes)
        self.outcome.notes.extend(plan.notes)
        return self._kept(attempts), dataclasses.replace(scope, recomputed=plan.copies_only)

    def _kept(self, attempts: list) -> list:
        """Record the final attempts of groups; the stitched ones."""
        self.outcome.attempts.extend(attempts)
        return [a for a in attempts if a.stitched]

    def _stitched_groups(self, scope: _Block, partitioned: list) -> list:
        """The stitched attempts of the partition's groups; a group that fails and whose rows may be
        split is retried as its parts that keep rows on chip (see `_groups`)."""
        stitched = []
        for members, parts in self._groups(scope.graph, partitioned):
            if _only_reshapes(scope.graph, members):
                continue  # TVM turns these into views that launch nothing
            whole = self._recomputing(scope, members)
            if whole.stitched or not parts:
                stitched += self._kept([whole])
                continue
            self.outcome.notes.append(f"[{','.join(whole.group.ops)}] stitched as {len(parts)} groups with rows "
                                      f"kept on chip: {whole.reason.text}")
            stitched += self._kept([self._recomputing(scope, part) for part in parts])
        return stitched

    def _recomputing(self, scope: _Block, members: list) -> Attempt:
        """The attempt of a group with the recomputed producers it reads; where that fails, of the
        group alone (the producers then keep their own launch)."""
        copies = recomputed_in(scope.graph, members, scope.recomputed)
        attempt = self.attempt(scope, members, copies)
        if attempt.stitched or not copies:
            return attempt
        self.outcome.notes.append(f"[{','.join(attempt.group.ops)}] stitched reading "
                                  f"[{','.join(attempt.group.recomputed_ops)}] instead of recomputing it: "
                                  f"{attempt.reason.text}")
        return self.attempt(scope, members)

    def _groups(self, graph: Graph, groups: list) -> list:
        """(group, parts) pairs of the partition's `groups`: a group whose rows may be split (see
        partition_limits) has as parts the groups that keep rows on chip, tried when the group itself
        cannot be stitched."""
        if self.on_chip_limits is None:
            return [(g, []) for g in groups]
        on_chip = partition(graph, self.on_chip_limits)
        out = []
        for members in groups:
            parts = [p for p in on_chip if set(p) <= set(members)]
            complete = sum(len(p) for p in parts) == len(members) and len(parts) > 1
            out.append((members, parts if complete else []))
        return out

    def _bindings(self, scope: _Block, stitched: list, used_after: set, calls: dict) -> list:
        """The block's bindings with each stitched group one call, in an order that respects every
        dependence, less the recomputed producers nothing reads, with independent kernels packed."""
        graph = scope.graph
        by_first = {a.group.members[0]: a for a in stitched}
        bindings = []
        for unit in _topological_units(graph, [list(a.group.members) for a in stitched]):
            attempt = by_first.get(unit[0])
            if attempt is not None and list(attempt.group.members) == unit:
                bindings.extend(_call_bindings(attempt.kernel.name, attempt.outlined, calls))
                continue
            node = graph.nodes[unit[0]]
            bindings.append(node.binding)
            bindings.extend(node.aliases)
        droppable = {v for r in scope.recomputed for v in _defined(graph.nodes[r])}
        bindings = _without_unused(bindings, droppable, used_after)
        kernels = self._packed_variants(bindings)
        try:
            return pack_block(bindings, kernels, calls, self.outcome.packs, lambda func: check_builds(func, self.target),
                              self._pack_in_time if self.target.kind.name == "cuda" else None)
        except Exception as err:  # noqa: BLE001 - packing is an optimisation: keep the kernels apart
            if self.strict:
                raise StitchError(f"cannot pack independent kernels: {err}") from err
            self.outcome.notes.append(f"independent kernels left unpacked: {type(err).__name__}: {err}")
            return bindings


def _call_bindings(name: str, outlined: Outlined, calls: dict) -> list:
    """The bindings of a stitched group: its call, and its outputs taken from the call's result."""
    out_ty = outlined.out_types if len(outlined.out_types) > 1 else outlined.out_types[0]
    call = relax.call_tir(calls[name], relax.Tuple(list(outlined.args)), out_ty)
    fields = outlined.fields or (0,) * len(outlined.outputs)
    if len(outlined.outputs) == 1 and not fields[0]:
        return [relax.VarBinding(outlined.outputs[0], call)]
    tmp = relax.DataflowVar(f"{name}_out", relax.TupleType(list(outlined.out_types)))
    bindings = [relax.VarBinding(tmp, call)]
    k = 0
    for var, count in zip(outlined.outputs, fields):
        if count:  # a tuple result: rebuilt from its fields
            value = relax.Tuple([relax.TupleGetItem(tmp, k + i) for i in range(count)])
        else:
            value = relax.TupleGetItem(tmp, k)
        bindings.append(relax.VarBinding(var, value))
        k += max(1, count)
    return bindings


def _rewritable(func) -> bool:
    """A Relax function of dataflow blocks the pass rewrites (not a primitive one)."""
    return (isinstance(func, relax.Function) and not (func.attrs is not None and func.attrs.get("Primitive"))
            and isinstance(func.body, relax.SeqExpr))


def _rewrite_function(stitcher: _Stitcher, name: str, func: relax.Function, calls: dict) -> relax.Function | None:
    """`func` with each dataflow block's groups stitched (None when nothing changed)."""
    bounds = function_bounds(func)
    blocks, changed = [], False
    for i, block in enumerate(func.body.blocks):
        if isinstance(block, relax.DataflowBlock):
            new_block = stitcher.rewrite_block(name, i, block, _used_after(func, i), calls, bounds)
            changed |= new_block is not block
            blocks.append(new_block)
        else:
            blocks.append(block)
    if not changed:
        return None
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def stitch_module(mod: tvm.IRModule, target: Target, strict: bool = False,
                  report: StitchReport | None = None, spec: TargetSpec | None = None,
                  choose=None, fusion: str = DEFAULT_FUSION) -> tvm.IRModule:
    """Stitch `mod` for `target`; plans are made for `spec` (default: `target`'s).

    `choose(fused, rule_plan, spec)` returns the plan to build (e.g. the cost
    model's pick among candidates.py's variants); None keeps the rule plan.
    `fusion`: "greedy" (partition.py) or "search" (fusion_search.py).
    """
    report = report if report is not None else StitchReport()
    spec = spec if spec is not None else TargetSpec.from_target(target)
    report.target = "cuda" if spec.family == "cuda" else "llvm"
    report.spec = spec
    stitcher = _Stitcher(mod, target, strict, spec, choose, fusion)
    bb = relax.BlockBuilder(mod)
    calls = _LazyGlobals(bb, stitcher.kernels)
    for gv, func in list(mod.functions_items()):
        if _rewritable(func):
            new_func = _rewrite_function(stitcher, gv.name_hint, func, calls)
            if new_func is not None:
                bb.update_func(gv, new_func)
    stitcher.outcome.into(report, stitcher.kernels)
    out = bb.get()
    out = relax.transform.Normalize()(out)
    return relax.transform.DeadCodeElimination()(out)


class _LazyGlobals(dict):
    """GlobalVars of stitched PrimFuncs, added to the module on first use."""

    def __init__(self, bb: relax.BlockBuilder, kernels: dict):
        super().__init__()
        self.bb = bb
        self.kernels = kernels  # name -> Kernel

    def __missing__(self, name: str):
        gv = self.bb.add_func(self.kernels[name].func, name)
        self[name] = gv
        return gv

    def add(self, name: str, func) -> tvm.ir.GlobalVar:
        """A new kernel made here (a packed one), added under a fresh name."""
        gv = self.bb.add_func(func, name)
        self[gv.name_hint] = gv
        return gv


def StitchFusion(target: Target | dict | str | StitchTarget | None = None, *, strict: bool = False,
                 report: StitchReport | None = None, emulate=None,
                 cost_model=True, spec: TargetSpec | None = None, fusion: str = DEFAULT_FUSION) -> tvm.transform.Pass:
    """The stitch pass, for pipelines of your own: run it after FuseOps and before FuseTIR.

    `target` defaults to the current target scope; plans are made for its
    `TargetSpec` (SMs, shared memory, cores, vector width...), read once per
    pass (a `StitchTarget` holds both, made once by `pipeline`). With
    `strict=True` a group that cannot be stitched raises
    StitchError instead of falling back. A `StitchReport` passed as `report`
    receives the plan or the fallback reason of every group.
    `emulate="cuda"` with an llvm target plans and schedules every kernel as
    for CUDA sm_90, without thread bindings, so the CUDA schedules run (and
    can be checked) on the CPU; a cuda target (Target, dict or string)
    instead of "cuda" plans for that GPU. With `cost_model=True` (the
    default) each kernel's configuration is picked among the rule plan's
    variants: on CUDA by the time model (each variant scheduled and priced,
    pricing/timed_choice.py), on the CPU by the family's shipped learned model
    (cost_model.SHIPPED); a model given (a `cost_model.Model`,
    or any object whose `costs(feature rows)` ranks candidates, lowest
    first) is used as given; `False` uses the rules only. `spec` plans for
    that `TargetSpec` instead of the target's own (another core count, an
    SM count no target attribute sets); its family must be the one planned
    for. `fusion="search"` (the default) chooses the groups by the fusion
    search (an integer program over the groups' modeled times,
    grouping/fusion_search.py; greedy's plan where the search finds nothing
    cheaper); "greedy" by the greedy partition (grouping/partition.py).
    """
    if fusion not in FUSION_METHODS:
        raise ValueError(f"fusion must be one of {', '.join(FUSION_METHODS)}, not {fusion!r}")
    if isinstance(target, StitchTarget):
        if emulate is not None or spec is not None:
            raise TypeError("a StitchTarget already holds what emulate and spec would set")
        fixed, emulation = target, None
    else:
        emulation = emulated(emulate)
        check_spec(spec)
        fixed = StitchTarget.checked(as_target(target), emulation, spec) if target is not None else None
    if not (isinstance(cost_model, bool) or callable(getattr(cost_model, "costs", None))):
        raise TypeError(f"cost_model must be True, False or a model with costs(rows), not {cost_model!r}")

    @tvm.transform.module_pass(opt_level=0, name="StitchFusion")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        made = fixed
        if made is None:
            current = Target.current(allow_none=True)
            if current is None:
                raise ValueError("StitchFusion needs a target: pass one or run it inside `with target:`")
            made = StitchTarget.checked(as_target(current), emulation, spec)
        return stitch_module(mod, made.target, strict, report, made.spec, _chooser(cost_model, made.spec.family),
                             fusion)

    return _pass


def _priced(fused: tvm.tirx.PrimFunc, plan: StitchPlan, spec: TargetSpec) -> StitchPlan:
    """`plan` with its modeled time (the rule plan where no model chooses; the CPU has no time model)."""
    if spec.family != "cuda":
        return plan
    return dataclasses.replace(plan, modeled_us=plan_us(fused, plan, spec))


def _chooser(model, family: str):
    """choose(fused, rule, spec) for the model asked for, or None where the rules decide; on CUDA
    the default (True) is the time model (pricing/timed_choice.py)."""
    if model is False:
        return None
    if model is True and family == "cuda":
        return choose_in_time
    if model is True:
        model = _cost_model.SHIPPED.get(family)
    return functools.partial(_cost_model.choose, model) if model is not None else None
