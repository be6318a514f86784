"""Whether launched groups can be ordered: the quotient graph of a choice of groups, and a cycle of it.

Each group being convex is not enough once there are several: with a -> b and
c -> d, the convex groups {a, d} and {b, c} each wait for the other. The
quotient graph has a unit per launched group and per fixed node (a binding
the search does not place); a unit depends on the unit owning each value it
reads from memory, and on the group owning each node it computes again (the
stitched call is emitted after the copied binding). A cycle found is returned as the groups on it, which the
integer program then forbids from being launched together (fusion_program.py).
"""

from __future__ import annotations


def _edges(producers, free, groups) -> tuple:
    """(units, successors): units are ("group", k) and ("node", fixed node); successors per unit."""
    owner = {u: ("group", k) for k, g in enumerate(groups) for u in g.owned}
    succ: dict = {("group", k): set() for k in range(len(groups))}
    succ.update({("node", n): set() for n in range(len(producers)) if n not in free})

    def source(p):
        return owner.get(p) if p in free else ("node", p)

    for k, g in enumerate(groups):
        inside = g.owned | g.recomputed
        for n in inside:
            for p in producers[n]:
                unit = None if p in inside else source(p)
                if unit is not None and unit != ("group", k):
                    succ[unit].add(("group", k))
        for r in g.recomputed:  # the copy is emitted after the binding it copies, in memory or not
            if owner.get(r, ("group", k)) != ("group", k):
                succ[owner[r]].add(("group", k))
    for n in range(len(producers)):
        if n in free:
            continue
        for p in producers[n]:
            unit = source(p)
            if unit is not None:
                succ[unit].add(("node", n))
    return succ


def quotient_cycle(producers, free, groups) -> list | None:
    """Indices into `groups` of the groups on a cycle of the quotient graph (fixed nodes left out), or
    None when it is acyclic. `producers[n]`: the nodes node n reads; `free`: the nodes the groups
    place; each group has `owned`, `recomputed` (sets of nodes)."""
    succ = _edges(producers, free, groups)
    state: dict = {}
    for root in succ:
        if root in state:
            continue
        path, stack = [root], [iter(sorted(succ[root]))]
        state[root] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(step) == 1:
                cycle = path[path.index(step):]
                return sorted(k for kind, k in cycle if kind == "group")
            if step not in state:
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(succ[step])))
    return None
