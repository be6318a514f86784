"""Memory-bound subgraph discovery: convex groups of stitchable nodes.

Groups grow greedily along producer -> consumer edges, in program order. Two
groups merge when
- the union is convex: no path leaves it and comes back through a node
  outside it (otherwise the fused call would depend on its own result);
- its ops share rows (see row_alignment) at some rank >= 1, or the union is
  small enough for one row task;
- the merge does not starve the kernel of parallelism: each part keeps at
  least half of the row tasks it had (capped at `parallel_rows`), unless the
  part is small;
- the per-row intermediates that must be materialised fit `row_bytes_limit`.
Nodes that join no other node stay singleton groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .graph import Graph
from .row_alignment import ALIGNED


@dataclass(frozen=True)
class PartitionLimits:
    parallel_rows: int = 128  # row tasks that fill the machine (about one wave on a GPU)
    small_work: int = 1 << 16  # elements below which parallelism does not matter
    row_bytes_limit: int = 48 * 1024  # per-row intermediates kept on chip


def _int_or_none(expr):
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _extent_value(text: str) -> int:
    """Integer value of a printed extent; symbolic extents count as large."""
    digits = text.replace("T.int64(", "").replace("T.int32(", "").rstrip(")")
    return int(digits) if digits.isdigit() else 1 << 20


def _elements(ty) -> int:
    total = 1
    for dim in ty.shape.values if hasattr(ty.shape, "values") else ty.shape:
        value = _int_or_none(dim)
        total *= value if value is not None else 1 << 10
    return total


def group_rank(graph: Graph, op_ids: set):
    """The highest rank at which the ops share aligned rows (0: one row task)."""
    ops = [graph.ops[i] for i in op_ids]
    top = min(op.rows.depth for op in ops)
    for rank in range(top, 0, -1):
        first = ops[0].rows.extents[:rank]
        if any(op.rows.extents[:rank] != first for op in ops[1:]):
            continue
        if all(
            op.rows.param_access[pos][rank] == ALIGNED
            for op in ops
            for pos, ref in enumerate(op.inputs)
            if ref.op in op_ids
        ):
            return rank
    return 0


def group_rows(graph: Graph, op_ids: set, rank: int) -> int:
    op = graph.ops[next(iter(op_ids))]
    total = 1
    for extent in op.rows.extents[:rank]:
        total *= _extent_value(extent)
    return total


def group_work(graph: Graph, op_ids: set) -> int:
    return max(_elements(t) for i in op_ids for t in graph.ops[i].out_types)


def materialized_row_bytes(graph: Graph, op_ids: set, rank: int) -> int:
    """Bytes per row of intermediates that cannot be inlined into consumers."""
    consumed = {ref.op for i in op_ids for ref in graph.ops[i].inputs if ref.op in op_ids}
    total = 0
    for i in consumed:
        op = graph.ops[i]
        if not op.cls.expensive and op.cls.kind.value != "reduction":
            continue
        for ty in op.out_types:
            per_row = 1
            for dim in list(ty.shape)[rank:]:
                value = _int_or_none(dim)
                per_row *= value if value is not None else 1 << 10
            total += per_row * _dtype_bytes(ty.dtype)
    return total


def _dtype_bytes(dtype) -> int:
    text = str(dtype)
    digits = "".join(ch for ch in text if ch.isdigit())
    return max(1, int(digits) // 8) if digits else 4


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


def partition(graph: Graph, limits: PartitionLimits = PartitionLimits()) -> list:
    """Convex groups of stitchable nodes, as lists of node indices in order."""
    desc = graph.descendants()
    anc = [0] * len(graph.nodes)
    for node, mask in enumerate(desc):
        rest = mask
        bit = 0
        while rest:
            if rest & 1:
                anc[bit] |= 1 << node
            rest >>= 1
            bit += 1
    group_of: dict = {}
    groups: dict = {}
    for node in graph.nodes:
        if not node.stitchable or not node.ops:
            continue
        ops = set(node.ops)
        rank = group_rank(graph, ops)
        groups[node.index] = Group(1 << node.index, ops, rank, group_rows(graph, ops, rank),
                                   group_work(graph, ops))
        group_of[node.index] = node.index

    def reach(mask: int, table: list) -> int:
        out, i, rest = 0, 0, mask
        while rest:
            if rest & 1:
                out |= table[i]
            rest >>= 1
            i += 1
        return out

    def keeps_parallelism(part: Group, rows: int) -> bool:
        if part.work <= limits.small_work:
            return True
        return 2 * min(rows, limits.parallel_rows) >= min(part.rows, limits.parallel_rows)

    for node in graph.nodes:
        if node.index not in group_of:
            continue
        for prod in sorted(graph.producers[node.index]):
            if prod not in group_of:
                continue
            a, b = groups[group_of[prod]], groups[group_of[node.index]]
            if a is b:
                continue
            mask = a.nodes | b.nodes
            if reach(mask, desc) & reach(mask, anc) & ~mask:
                continue
            ops = a.ops | b.ops
            rank = group_rank(graph, ops)
            rows = group_rows(graph, ops, rank)
            work = max(a.work, b.work)
            if rank == 0 and work > limits.small_work:
                continue
            if not (keeps_parallelism(a, rows) and keeps_parallelism(b, rows)):
                continue
            if materialized_row_bytes(graph, ops, rank) > limits.row_bytes_limit:
                continue
            merged = Group(mask, ops, rank, rows, work)
            del groups[group_of[prod]], groups[group_of[node.index]]
            key = merged.node_list()[0]
            groups[key] = merged
            for member in merged.node_list():
                group_of[member] = key
    return sorted((g.node_list() for g in groups.values()), key=lambda nodes: nodes[0])
