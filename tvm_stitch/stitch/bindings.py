"""A block's bindings with its stitched groups in place: what the groups read and leave, the order every
dependence allows, and the call of each stitched group with its outputs taken from the call's result."""

from __future__ import annotations

import heapq

from tvm import relax

from tvm_stitch.analysis.graph import Graph
from tvm_stitch.kernels.outline import Outlined
from tvm_stitch.stitch.records import StitchError


def used_after(func: relax.Function, block_index: int) -> set:
    """Variables of block `block_index` used by later blocks or the result."""
    used = set(relax.analysis.free_vars(func.body.body))
    for block in func.body.blocks[block_index + 1 :]:
        for binding in block.bindings:
            used.update(relax.analysis.free_vars(binding.value))
    return used


def only_reshapes(graph: Graph, members: list) -> bool:
    ops = [graph.ops[i] for m in members for i in graph.nodes[m].ops]
    return bool(ops) and all(relax.analysis.has_reshape_pattern(op.func) for op in ops)


def defined(node) -> list:
    return [node.var] + [a.var for a in node.aliases]


def still_read(graph: Graph, recomputed: frozenset, stitched: list) -> frozenset:
    """The recomputed producers read from memory — by a node outside the `stitched` groups (attempts;
    a group that fell back, a reshape left to TVM) or by a group stitched without its copies —
    directly or through each other: they are computed once, in memory."""
    inside = {m for attempt in stitched for m in attempt.group.members}
    read = {p for node in graph.nodes if node.index not in inside and node.index not in recomputed
            for p in graph.producers[node.index] if p in recomputed}
    args = {arg for attempt in stitched for arg in attempt.outlined.args if isinstance(arg, relax.Var)}
    read.update(p for p in recomputed if any(v in args for v in defined(graph.nodes[p])))
    stack = list(read)
    while stack:
        for p in graph.producers[stack.pop()]:
            if p in recomputed and p not in read:
                read.add(p)
                stack.append(p)
    return frozenset(read)


def without_unused(bindings: list, droppable: set, used_after: set) -> list:
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


def topological_units(graph: Graph, groups: list) -> list:
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


def call_bindings(name: str, outlined: Outlined, calls: dict) -> list:
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
