"""Memory-bound subgraph discovery: convex groups of stitchable nodes.

Groups grow greedily along producer -> consumer edges, in program order. Two
groups merge when
- the union holds at most `max_reductions` reductions and `max_ops` ops (a
  kernel's compile time grows faster than its size: a chain of K LayerNorms
  becomes K / 4 kernels of four, identical ones made once);
- the union is convex: no path leaves it and comes back through a node
  outside it (otherwise the fused call would depend on its own result);
- its ops share rows (see row_alignment) at some rank >= 1, or rows at
  dimensions that do not lead (BatchNorm's channel: analysis/row_axes.py),
  or the union is small enough for one row task (and of static size, as the
  planners require);
- the merge does not starve the kernel of parallelism: each part keeps at
  least half of the row tasks it had (capped at `parallel_rows`), unless the
  part is small;
- the per-row intermediates that must be materialised fit `row_bytes_limit`.
The last two do not apply to a union of few long rows (`long_rows_below`
rows of at least `long_row` elements): its rows are split over blocks, and
nothing is kept on chip per row.
Nodes that join no other node stay singleton groups. The limits are the
target's, made by planning/limits.py (`partition_limits(spec)`).

Cheap producers that read no tensor (or only tiny ones) — the positions and
masks computed from `arange` of a symbolic length, which a static build
folds to constants — join no group: each group that reads one recomputes it
(`recomputed_producers`, `recomputed_in`), as XLA and AStitch duplicate such
producers, instead of launching it on its own and reading its result back.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from tvm_stitch.analysis.classify import OpKind
from tvm_stitch.analysis.graph import Graph, inlined_in_group
from tvm_stitch.analysis.row_axes import group_row_count
from tvm_stitch.analysis.tir_view import static_int
from tvm_stitch.analysis.row_alignment import ALIGNED
from tvm_stitch.grouping.whole_tensor import whole_tensor_group


SYMBOLIC_ROWS = 1 << 20  # row count assumed for a symbolic row extent: many


def _estimated_elements(dims) -> int:
    """Element count of some dims; a symbolic dim counts as 1024."""
    total = 1
    for dim in dims:
        value = static_int(dim)
        total *= value if value is not None else 1 << 10
    return total


def group_rows(graph: Graph, op_ids: set) -> tuple:
    """(rank, rows): the highest rank at which the ops share aligned rows (0: one row task),
    and the number of row tasks at that rank. With no leading row axis in common, the rows
    they share at other dimensions (`group_row_count`): rank is then their number of axes.

    Ops the kernel will inline (see `inlined_in_group`) are left out: once
    inlined, their loads happen in their consumers' loops.
    """
    every = set(op_ids)
    inlined = inlined_in_group(graph, op_ids) if len(op_ids) > 1 else set()
    op_ids = set(op_ids) - inlined
    ops = [graph.ops[i] for i in op_ids]
    rank = 0
    for candidate in range(min(op.rows.depth for op in ops), 0, -1):
        first = ops[0].rows.exprs[:candidate]
        if any(op.rows.exprs[:candidate] != first for op in ops[1:]):
            continue
        if all(
            op.rows.param_access[pos][candidate] == ALIGNED
            for op in ops
            for pos, ref in enumerate(op.inputs)
            if ref.op in op_ids
        ):
            rank = candidate
            break
    extents = ops[0].rows.extents[:rank]
    strided = group_row_count(graph.ops, every) if rank == 0 and len(every) > 1 else None
    if strided is not None:
        rank, extents = strided[0], [static_int(e) for e in strided[1]]
    rows = 1
    for extent in extents:
        rows *= extent if extent is not None else SYMBOLIC_ROWS
    return rank, rows


def group_work(graph: Graph, op_ids: set) -> int:
    return max(_estimated_elements(t.shape) for i in op_ids for t in graph.ops[i].out_types)


def _symbolic_work(graph: Graph, op_ids: set) -> bool:
    """Whether an op of the group has a symbolic extent: the planners make no single row task of it."""
    return any(static_int(d) is None for i in op_ids for t in graph.ops[i].out_types for d in t.shape)


def materialized_row_bytes(graph: Graph, op_ids: set, rank: int) -> int:
    """Bytes per row of intermediates that cannot be inlined into consumers."""
    consumed = {ref.op for i in op_ids for ref in graph.ops[i].inputs if ref.op in op_ids}
    total = 0
    for i in consumed:
        op = graph.ops[i]
        if not op.cls.expensive and op.cls.kind != OpKind.REDUCTION:
            continue
        for ty in op.out_types:
            total += _estimated_elements(list(ty.shape)[rank:]) * max(1, tvm.DataType(str(ty.dtype)).bits // 8)
    return total


def within_size(graph: Graph, op_ids: set, limits) -> bool:
    """Whether a group of these ops is within the limits' reductions and ops (compile time)."""
    reductions = sum(1 for i in op_ids if graph.ops[i].cls.kind == OpKind.REDUCTION)
    return len(op_ids) <= limits.max_ops and reductions <= limits.max_reductions


@dataclass
class Group:
    nodes: int  # bitmask of node indices
    ops: set
    rank: int
    rows: int
    work: int

    def node_list(self) -> list:
        out, mask, i = [], self.nodes, 0
        while mask:
            if mask & 1:
                out.append(i)
            mask >>= 1
            i += 1
        return out


def _cheap_spatial(op) -> bool:
    return op.cls.kind in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.INJECTIVE) and not op.cls.expensive


def _tiny_external(graph: Graph, index: int, limits) -> bool:
    """Whether external value `index` is a non-tensor (a shape) or a tensor of at most
    `limits.recompute_input_elements` elements."""
    ty = getattr(graph.externals[index], "ty", None)
    if not isinstance(ty, relax.TensorType):
        return True
    if not isinstance(ty.shape, relax.ShapeExpr):
        return False
    total = 1
    for dim in ty.shape.values:
        value = static_int(dim)
        if value is None:
            return False
        total *= value
    return total <= limits.recompute_input_elements


def _sliced_constant(graph: Graph, index: int, op) -> bool:
    """Whether external value `index` is a constant (a model's buffer: position ids, token types)
    that `op`, of a symbolic extent, reads: a slice or gather of it sized by the symbolic length,
    which a static build folds. Its readers recomputing `op` read no more of it than they would
    read of `op`'s result."""
    return isinstance(graph.externals[index], tvm.ir.Constant) and any(
        static_int(d) is None for ty in op.out_types for d in ty.shape)


def recomputed_producers(graph: Graph, limits) -> frozenset:
    """Nodes each consuming group recomputes instead of reading (see the module docstring).

    A node qualifies when its ops are cheap spatial ones (no reduction, no
    expensive intrinsic), each reading only tiny external values, constants
    it slices to a symbolic length (`_sliced_constant`) or other qualifying nodes, and its result is read by stitchable nodes only (not by
    opaque bindings, later blocks or the function's result, which need it in
    memory anyway).
    """
    candidates = {node.index for node in graph.nodes
                  if node.stitchable and node.ops and all(_cheap_spatial(graph.ops[i]) for i in node.ops)}
    changed = True
    while changed:
        changed = False
        for index in sorted(candidates):
            ok = all(
                (ref.op < 0 and (_tiny_external(graph, ref.output, limits)
                                 or _sliced_constant(graph, ref.output, graph.ops[i])))
                or (ref.op >= 0 and graph.ops[ref.op].node in candidates)
                for i in graph.nodes[index].ops for ref in graph.ops[i].inputs)
            if not ok:
                candidates.discard(index)
                changed = True
    consumers = graph.consumers
    return frozenset(index for index in candidates
                     if consumers[index] and not any(i in graph.escapes for i in graph.nodes[index].ops))


def recomputed_in(graph: Graph, members: list, recomputed: frozenset) -> list:
    """The recomputed producers a group of `members` reads, directly or through each other, in order."""
    found: set = set()
    stack = [p for m in members for p in graph.producers[m] if p in recomputed]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(p for p in graph.producers[node] if p in recomputed)
    return sorted(found)


class _Merger:
    """Groups and the checks that decide whether two may become one."""

    def __init__(self, graph: Graph, limits, among: frozenset | None):
        self.graph = graph
        self.limits = limits
        self.recomputed = recomputed_producers(graph, limits) if among is None else frozenset()
        self.desc = graph.descendants()
        self.anc = [0] * len(graph.nodes)
        for node, mask in enumerate(self.desc):
            for bit in _bits(mask):
                self.anc[bit] |= 1 << node
        self.groups: dict = {}
        self.group_of: dict = {}
        for node in graph.nodes:
            if node.stitchable and node.ops and node.index not in self.recomputed and (
                    among is None or node.index in among):
                ops = set(node.ops)
                rank, rows = group_rows(graph, ops)
                self.groups[node.index] = Group(1 << node.index, ops, rank, rows, group_work(graph, ops))
                self.group_of[node.index] = node.index

    def _reach(self, mask: int, table: list) -> int:
        out = 0
        for bit in _bits(mask):
            out |= table[bit]
        return out

    def _keeps_parallelism(self, part: Group, rows: int) -> bool:
        if part.work <= self.limits.small_work:
            return True
        cap = self.limits.parallel_rows
        return 2 * min(rows, cap) >= min(part.rows, cap)

    def merged(self, a: Group, b: Group, same_rows: bool = False):
        """The union of two groups if it is convex and can be one kernel, else None."""
        mask = a.nodes | b.nodes
        if self._reach(mask, self.desc) & self._reach(mask, self.anc) & ~mask:
            return None
        ops = a.ops | b.ops
        if not within_size(self.graph, ops, self.limits):
            return None
        rank, rows = group_rows(self.graph, ops)
        work = max(a.work, b.work)
        if rank == 0 and whole_tensor_group(self.graph, ops):
            return Group(mask, ops, rank, rows, work)  # column-split cuts it over blocks
        if rank == 0 and (work > self.limits.small_work or _symbolic_work(self.graph, ops)):
            return None
        if same_rows and (rank == 0 or rows != a.rows or rows != b.rows):
            return None
        if rows < self.limits.long_rows_below and work // max(1, rows) >= self.limits.long_row:
            return Group(mask, ops, rank, rows, work)
        if not (self._keeps_parallelism(a, rows) and self._keeps_parallelism(b, rows)):
            return None
        if materialized_row_bytes(self.graph, ops, rank) > self.limits.row_bytes_limit:
            return None
        return Group(mask, ops, rank, rows, work)

    def replace(self, keys: tuple, merged: Group) -> None:
        for key in keys:
            del self.groups[key]
        key = merged.node_list()[0]
        self.groups[key] = merged
        for member in merged.node_list():
            self.group_of[member] = key

    def inputs(self, group: Group) -> set:
        """The values the group reads from memory (recomputed producers' results are not)."""
        return {ref for i in group.ops for ref in self.graph.ops[i].inputs
                if ref.op not in group.ops and (ref.op < 0 or self.graph.ops[ref.op].node not in self.recomputed)}


    def sources(self, group: Group) -> set:
        """What the group reads: the values it reads from memory and the recomputed producers it
        recomputes (two groups recomputing the same producer compute it once when they join)."""
        return self.inputs(group) | {("recomputed", p) for m in group.node_list()
                                     for p in self.graph.producers[m] if p in self.recomputed}


def _bits(mask: int):
    index = 0
    while mask:
        if mask & 1:
            yield index
        mask >>= 1
        index += 1


def partition(graph: Graph, limits, among: frozenset | None = None) -> list:
    """Convex groups of stitchable nodes, as lists of node indices in order.

    `limits`: the target's PartitionLimits (planning/limits.py). The
    recomputed producers are in no group (see `recomputed_in`). `among`:
    group only these nodes, recomputing nothing (recomputed producers that a
    group falling back still reads from memory).

    First along producer -> consumer edges; then siblings that read a common
    input over the same rows (dgamma and dbeta of a LayerNorm backward) join,
    so the input is read by one kernel; and so do siblings recomputing a common producer
    (the cos and sin of the same rotary angles).
    """
    m = _Merger(graph, limits, among)
    for node in graph.nodes:
        if node.index not in m.group_of:
            continue
        for prod in sorted(graph.producers[node.index]):
            if prod not in m.group_of:
                continue
            ka, kb = m.group_of[prod], m.group_of[node.index]
            if ka == kb:
                continue
            merged = m.merged(m.groups[ka], m.groups[kb])
            if merged is not None:
                m.replace((ka, kb), merged)
    changed = True
    while changed:
        changed = False
        keys = sorted(m.groups)
        for x, ka in enumerate(keys):
            for kb in keys[x + 1:]:
                a, b = m.groups[ka], m.groups[kb]
                if not m.sources(a) & m.sources(b):
                    continue
                merged = m.merged(a, b, same_rows=True)
                if merged is not None:
                    m.replace((ka, kb), merged)
                    changed = True
                    break
            if changed:
                break
    return sorted((g.node_list() for g in m.groups.values()), key=lambda nodes: nodes[0])
