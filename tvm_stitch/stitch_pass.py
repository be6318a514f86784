"""StitchFusion: the Relax pass that stitches memory-bound groups into scheduled kernels.

Runs after FuseOps. Per dataflow block: build the graph, partition it into
convex memory-bound groups, and for each group outline -> FuseTIR -> plan ->
schedule, everything for the TargetSpec read once per run from the target
(or given). A group that succeeds becomes one `call_tir` of a scheduled
PrimFunc (attribute `tirx.is_scheduled`, so dlight leaves it alone, and
`tvm_stitch.plan` holding its plan). A group that fails at any step keeps
its original bindings — TVM's default path — and the reason is recorded.
Finally, independent barrier-free kernels of a block share launches
(packing.py).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import tvm
import tvm_ffi
from tvm import relax
from tvm.target import Target

from schedules import schedule_for
from tvm_stitch.analysis.graph import Graph, analyses_for, build_graph
from tvm_stitch.analysis.size_bounds import at_upper_bounds, function_bounds, with_size_bounds
from tvm_stitch.check.builds import check_builds
from tvm_stitch.check.traffic import modeled_traffic
from tvm_stitch.fusion.outline import outline_group
from tvm_stitch.fusion.packing import pack_block, pack_groups, packable
from tvm_stitch.fusion.partition import partition, recomputed_in, recomputed_producers
from tvm_stitch.planning import cost_model as _cost_model
from tvm_stitch.planning.limits import partition_limits
from tvm_stitch.planning.planner import plan_kernel
from tvm_stitch.planning.spec import DEFAULT_ARCH, TargetSpec
from tvm_stitch.report import GroupRecord, StitchReport
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
    """The recomputed producers read from memory — by a node outside the stitched groups (a group that
    fell back, a reshape left to TVM) or by a group stitched without its copies — directly or through
    each other: they are computed once, in memory."""
    inside = {m for members, _ in stitched for m in members}
    read = {p for node in graph.nodes if node.index not in inside and node.index not in recomputed
            for p in graph.producers[node.index] if p in recomputed}
    args = {arg for _, (_, outlined) in stitched for arg in outlined.args if isinstance(arg, relax.Var)}
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


class _Stitcher:
    def __init__(self, mod: tvm.IRModule, target: Target, strict: bool, report: StitchReport,
                 spec: TargetSpec, choose=None):
        self.mod = mod
        self.choose = choose  # (fused, rule plan, spec) -> the plan to use; None: the rule plan
        self.target = target
        self.spec = spec
        self.limits = partition_limits(spec)  # what the partition may group, for every block
        self.strict = strict
        self.report = report
        self.analyses = analyses_for(mod)
        self.new_funcs: dict = {}  # name -> scheduled PrimFunc
        self.plans: dict = {}  # name -> StitchPlan
        self.done: dict = {}  # structural hash of a fused PrimFunc -> [(fused, kernel name, plan)]
        # name -> (scheduled PrimFunc, plan) of a one-launch column-split kernel's thread-per-column
        # plan, which packing may share a launch with others (see _packed_variants)
        self.walks: dict = {}
        self.count = 0
        self.bounds: dict = {}  # bounds of the sizes of the function being rewritten (size_bounds)

    def stitch_group(self, func_name: str, graph: Graph, members: list, where: dict, recomputed: list = ()):
        """(PrimFunc name, outlined) for a stitched group, or None after recording why.

        `where`: binding variable -> (dataflow block index, binding index) in the function.
        `recomputed`: producer nodes the kernel computes again (partition.recomputed_in).
        """
        nodes = [graph.nodes[m] for m in members]
        record = GroupRecord(
            function=func_name,
            bindings=tuple(n.var.name for n in nodes),
            positions=tuple(where[n.var] for n in nodes),
            ops=tuple(graph.ops[i].name for n in nodes for i in n.ops),
            op_kinds=tuple(graph.ops[i].cls.describe() for n in nodes for i in n.ops),
            recomputed=tuple(graph.ops[i].name for m in recomputed for i in graph.nodes[m].ops),
        )
        self.report.groups.append(record)
        try:
            outlined = outline_group(self.mod, graph, members, f"stitch_{self.count}", recomputed)
            fused = with_size_bounds(outlined.func, outlined.args, self.bounds)
            name, plan = self._kernel_for(fused, record.ops)
        except Exception as err:  # noqa: BLE001 - any failure of a group means: fall back
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"
            if self.strict:
                raise StitchError(f"cannot stitch {list(record.ops)}: {reason}") from err
            record.fallback = reason
            return None
        record.kernel, record.plan = name, plan
        return name, outlined

    def _kernel_for(self, fused, ops: tuple) -> tuple:
        """(name, plan) of the scheduled kernel for a fused PrimFunc; identical groups share one."""
        key = tvm_ffi.structural_hash(fused)
        for other, name, plan in self.done.get(key, []):
            if tvm_ffi.structural_equal(other, fused):
                return name, plan
        name = f"stitch_{self.count}_{'_'.join(ops[:3])}"[:60]
        rule = plan_kernel(fused, self.spec, name)
        plan = self.choose(fused, rule, self.spec) if self.choose is not None else rule
        try:
            scheduled = self._scheduled(fused, plan)
        except Exception as err:  # noqa: BLE001 - the model's choice failed: the rules' plan is the fallback
            if plan is rule:
                raise
            self.report.notes.append(f"{name}: the cost model's choice did not build "
                                     f"({type(err).__name__}); the rule plan is used")
            plan, scheduled = rule, self._scheduled(fused, rule)
        traffic, note = _modeled_traffic(scheduled, self.spec)
        if note:
            plan = dataclasses.replace(plan, notes=plan.notes + (note,))
        if traffic is not None:
            plan = dataclasses.replace(plan, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        self.count += 1
        self.new_funcs[name] = scheduled.with_attr("tvm_stitch.plan", plan.to_json())
        self.plans[name] = plan
        self.done.setdefault(key, []).append((fused, name, plan))
        if plan.scheme == "column-split" and plan.kernels == 1:
            self._walk_variant(fused, name)
        return name, plan

    def _walk_variant(self, fused, name: str) -> None:
        """Record the thread-per-column plan of a column-split kernel when it is packable."""
        try:
            walk = plan_kernel(fused, self.spec, name, columns=False)
            if not packable(walk):
                return
            scheduled = self._scheduled(fused, walk)
        except Exception:  # noqa: BLE001 - no variant: the column-split kernel stays
            return
        traffic, _ = _modeled_traffic(scheduled, self.spec)
        if traffic is not None:
            walk = dataclasses.replace(walk, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal)
        self.walks[name] = (scheduled.with_attr("tvm_stitch.plan", walk.to_json()), walk)

    def _packed_variants(self, bindings: list, kernels: dict) -> dict:
        """`kernels`, where packing the thread-per-column plans of the column-split kernels would save
        more launches than packing the column-split kernels (with those of their block shape), with
        each column-split kernel that the walks' packs take replaced by its walk: launch counts never
        rise for the threads gained."""
        trial = {name: self.walks.get(name, kernel) for name, kernel in kernels.items()}
        walk_packs = pack_groups(bindings, trial)
        if _saved(walk_packs) <= _saved(pack_groups(bindings, kernels)):
            return kernels
        packed = {bindings[i].value.args[0].name_hint for members in walk_packs for i in members}
        for name in packed & set(self.walks):
            func, walk = self.walks.pop(name)
            self.new_funcs[name], self.plans[name] = func, walk
            kernels[name] = (func, walk)
            for record in self.report.groups:
                if record.kernel == name:
                    record.plan = walk
            for entries in self.done.values():
                entries[:] = [(f, n, walk if n == name else p) for f, n, p in entries]
        return kernels

    def _scheduled(self, fused, plan):
        sch = schedule_for(fused, plan, self.target)
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        check_builds(scheduled, self.target)
        return scheduled

    def rewrite_block(self, func_name: str, block_index: int, block: relax.DataflowBlock, used_after: set,
                      calls: dict) -> relax.DataflowBlock:
        graph = build_graph(self.mod, block, used_after, self.analyses)
        where = {b.var: (block_index, k) for k, b in enumerate(block.bindings)}
        for node in graph.nodes:
            if not node.stitchable:
                self.report.opaque.append((node.var.name, node.reason))
        recomputed = recomputed_producers(graph, self.limits)
        stitched = []
        for members, parts in self._groups(graph):
            if _only_reshapes(graph, members):
                continue  # TVM turns these into views that launch nothing
            result = self._stitch_recomputing(func_name, graph, members, where, recomputed)
            if result is not None:
                stitched.append((members, result))
                continue
            if parts:
                failed = self.report.groups.pop()
                self.report.notes.append(f"[{','.join(failed.ops)}] stitched as {len(parts)} groups with rows "
                                         f"kept on chip: {failed.fallback}")
                for part in parts:
                    part_result = self._stitch_recomputing(func_name, graph, part, where, recomputed)
                    if part_result is not None:
                        stitched.append((part, part_result))
        for members in partition(graph, self.limits, among=_still_read(graph, recomputed, stitched)):
            if not _only_reshapes(graph, members):
                result = self.stitch_group(func_name, graph, members, where)
                if result is not None:
                    stitched.append((members, result))
        if not stitched:
            return block
        by_first = {members[0]: (members, result) for members, result in stitched}
        bindings = []
        for unit in _topological_units(graph, [m for m, _ in stitched]):
            if unit[0] in by_first and by_first[unit[0]][0] == unit:
                name, outlined = by_first[unit[0]][1]
                bindings.extend(self._call_bindings(name, outlined, calls))
                continue
            node = graph.nodes[unit[0]]
            bindings.append(node.binding)
            bindings.extend(node.aliases)
        bindings = _without_unused(bindings, {v for r in recomputed for v in _defined(graph.nodes[r])}, used_after)
        kernels = self._packed_variants(bindings, {name: (self.new_funcs[name], plan)
                                                   for name, plan in self.plans.items()})
        try:
            bindings = pack_block(bindings, kernels, calls, self.report,
                                  lambda func: check_builds(func, self.target))
        except Exception as err:  # noqa: BLE001 - packing is an optimisation: keep the kernels apart
            if self.strict:
                raise StitchError(f"cannot pack independent kernels: {err}") from err
            self.report.notes.append(f"independent kernels left unpacked: {type(err).__name__}: {err}")
        return relax.DataflowBlock(bindings)

    def _stitch_recomputing(self, func_name: str, graph: Graph, members: list, where: dict, recomputed):
        """`stitch_group` with the recomputed producers the group reads; where that fails, the group
        alone (the producers then keep their own launch)."""
        copies = recomputed_in(graph, members, recomputed)
        result = self.stitch_group(func_name, graph, members, where, copies)
        if result is None and copies:
            failed = self.report.groups.pop()
            self.report.notes.append(f"[{','.join(failed.ops)}] stitched reading [{','.join(failed.recomputed)}] "
                                     f"instead of recomputing it: {failed.fallback}")
            result = self.stitch_group(func_name, graph, members, where)
        return result

    def _groups(self, graph: Graph) -> list:
        """(group, parts) pairs: a group whose rows may be split (see partition_limits) has as parts the
        groups that keep rows on chip, tried when the group itself cannot be stitched."""
        groups = partition(graph, self.limits)
        if self.spec.family != "cuda":
            return [(g, []) for g in groups]
        on_chip = partition(graph, partition_limits(self.spec, split_long_rows=False))
        out = []
        for members in groups:
            parts = [p for p in on_chip if set(p) <= set(members)]
            complete = sum(len(p) for p in parts) == len(members) and len(parts) > 1
            out.append((members, parts if complete else []))
        return out

    def _call_bindings(self, name: str, outlined, calls: dict) -> list:
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


def stitch_module(mod: tvm.IRModule, target: Target, strict: bool = False,
                  report: StitchReport | None = None, spec: TargetSpec | None = None,
                  choose=None) -> tvm.IRModule:
    """Stitch `mod` for `target`; plans are made for `spec` (default: `target`'s).

    `choose(fused, rule_plan, spec)` returns the plan to build (e.g. the cost
    model's pick among candidates.py's variants); None keeps the rule plan.
    """
    report = report if report is not None else StitchReport()
    spec = spec if spec is not None else TargetSpec.from_target(target)
    report.target = "cuda" if spec.family == "cuda" else "llvm"
    report.spec = spec
    stitcher = _Stitcher(mod, target, strict, report, spec, choose)
    bb = relax.BlockBuilder(mod)
    calls = _LazyGlobals(bb, stitcher.new_funcs)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        if func.attrs is not None and func.attrs.get("Primitive"):
            continue
        if not isinstance(func.body, relax.SeqExpr):
            continue
        blocks = []
        changed = False
        stitcher.bounds = function_bounds(func)
        for i, block in enumerate(func.body.blocks):
            if isinstance(block, relax.DataflowBlock):
                new_block = stitcher.rewrite_block(gv.name_hint, i, block, _used_after(func, i), calls)
                changed |= new_block is not block
                blocks.append(new_block)
            else:
                blocks.append(block)
        if changed:
            new_func = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                      func.ret_ty, func.is_pure, func.attrs, func.span)
            bb.update_func(gv, new_func)
    out = bb.get()
    out = relax.transform.Normalize()(out)
    return relax.transform.DeadCodeElimination()(out)


class _LazyGlobals(dict):
    """GlobalVars of stitched PrimFuncs, added to the module on first use."""

    def __init__(self, bb: relax.BlockBuilder, funcs: dict):
        super().__init__()
        self.bb = bb
        self.funcs = funcs

    def __missing__(self, name: str):
        gv = self.bb.add_func(self.funcs[name], name)
        self[name] = gv
        return gv

    def add(self, name: str, func) -> tvm.ir.GlobalVar:
        """A new kernel made here (a packed one), added under a fresh name."""
        gv = self.bb.add_func(func, name)
        self[gv.name_hint] = gv
        return gv


def StitchFusion(target: Target | dict | str | None = None, *, strict: bool = False,
                 report: StitchReport | None = None, emulate=None,
                 cost_model=True, spec: TargetSpec | None = None) -> tvm.transform.Pass:
    """The stitch pass, for pipelines of your own: run it after FuseOps and before FuseTIR.

    `target` defaults to the current target scope; plans are made for its
    `TargetSpec` (SMs, shared memory, cores, vector width...), read once per
    run. With `strict=True` a group that cannot be stitched raises
    StitchError instead of falling back. A `StitchReport` passed as `report`
    receives the plan or the fallback reason of every group.
    `emulate="cuda"` with an llvm target plans and schedules every kernel as
    for CUDA sm_90, without thread bindings, so the CUDA schedules run (and
    can be checked) on the CPU; a cuda target (Target, dict or string)
    instead of "cuda" plans for that GPU. With `cost_model=True` (the
    default) the target family's shipped model (cost_model.SHIPPED) picks each
    kernel's configuration among the rule plan's variants, where a model is
    shipped for the family (the CPU); a model given (a `cost_model.Model`,
    or any object whose `costs(feature rows)` ranks candidates, lowest
    first) is used as given; `False` uses the rules only. `spec` plans for
    that `TargetSpec` instead of the target's own (another core count, an
    SM count no target attribute sets); its family must be the one planned
    for.
    """
    fixed = as_target(target) if target is not None else None
    emulated = _emulated(emulate)
    if spec is not None and not isinstance(spec, TargetSpec):
        raise TypeError(f"spec must be a TargetSpec, not {type(spec).__name__}")
    if not (isinstance(cost_model, bool) or callable(getattr(cost_model, "costs", None))):
        raise TypeError(f"cost_model must be True, False or a model with costs(rows), not {cost_model!r}")

    @tvm.transform.module_pass(opt_level=0, name="StitchFusion")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        tgt = fixed if fixed is not None else Target.current(allow_none=True)
        if tgt is None:
            raise ValueError("StitchFusion needs a target: pass one or run it inside `with target:`")
        tgt = as_target(tgt)
        if emulated is not None and tgt.kind.name != "llvm":
            raise ValueError(f"emulate={emulate!r} needs an llvm target, not {tgt.kind.name!r}")
        planned = TargetSpec.from_target(emulated if emulated is not None else tgt)
        if spec is not None and spec.family != planned.family:
            raise ValueError(f"spec is for {spec.family}, but the plans are for {planned.family}")
        used = spec if spec is not None else planned
        return stitch_module(mod, tgt, strict, report, used, _chooser(cost_model, used.family))

    return _pass


def _chooser(model, family: str):
    """choose(fused, rule, spec) for the model asked for, or None where the rules decide."""
    if model is False:
        return None
    if model is True:
        model = _cost_model.SHIPPED.get(family)
    return functools.partial(_cost_model.choose, model) if model is not None else None


def _emulated(emulate) -> Target | None:
    """The cuda Target that `emulate` asks plans for (None: no emulation)."""
    if emulate is None:
        return None
    if isinstance(emulate, str) and emulate == "cuda":
        return Target({"kind": "cuda", "arch": DEFAULT_ARCH})
    try:
        target = as_target(emulate)
    except (TypeError, ValueError) as err:
        raise ValueError(f"emulate must be None, 'cuda' or a cuda target, not {emulate!r}") from err
    if target.kind.name != "cuda":
        raise ValueError(f"emulate must be None, 'cuda' or a cuda target, not {emulate!r}")
    return target

