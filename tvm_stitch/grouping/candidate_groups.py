"""The candidate groups of the fusion search: convex, connected sets of free nodes, with what they recompute.

Enumerated from each free node outwards, in the spirit of FusionStitching's
pruned search: a set grows by one neighbour at a time (a producer, a
consumer, or a sibling reading a common value), breadth first, staying
convex and passing `admissible` where the caller gives one; at
most `max_size` nodes and `per_seed` sets from each node; a set reached from
several seeds is kept once. Each set `owned` comes with the variants of what
it recomputes instead of reading: nothing, and the recomputable free nodes
that feed it (directly, or through each other, `depth` steps up) where the
union stays convex and admissible. Pricing (fusion_search.py) then drops the
candidates whose plan fails.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Structure:
    """What the enumeration needs of a block's graph."""

    producers: tuple  # per node: frozenset of the nodes it reads
    free: frozenset  # nodes the search places
    recomputable: frozenset  # free nodes a group may compute again for itself (no reduction)
    siblings: tuple  # per node: frozenset of the nodes reading a value it reads too


@dataclass(frozen=True)
class SearchLimits:
    max_size: int = 8  # nodes of a set at most
    per_seed: int = 12  # sets grown from one node at most
    depth: int = 2  # producer steps a recomputed node may be above the set


def _consumers(producers) -> list:
    out = [set() for _ in producers]
    for n, prods in enumerate(producers):
        for p in prods:
            out[p].add(n)
    return out


def reachability(producers) -> tuple:
    """(descendants, ancestors) bitmasks per node."""
    consumers = _consumers(producers)
    desc = [0] * len(producers)
    for n in reversed(range(len(producers))):
        for c in consumers[n]:
            desc[n] |= (1 << c) | desc[c]
    anc = [0] * len(producers)
    for n in range(len(producers)):
        for p in producers[n]:
            anc[n] |= (1 << p) | anc[p]
    return desc, anc


def convex(nodes, desc, anc) -> bool:
    """No path leaves the set and comes back."""
    mask = sum(1 << n for n in nodes)
    below = above = 0
    for n in nodes:
        below |= desc[n]
        above |= anc[n]
    return not (below & above & ~mask)


class _Enumeration:
    def __init__(self, structure: Structure, admissible, limits: SearchLimits):
        self.s = structure
        self.admissible = admissible
        self.limits = limits
        self.desc, self.anc = reachability(structure.producers)
        consumers = _consumers(structure.producers)
        # A sibling with a path to or from the node outside the two never makes a convex set with it unless
        # the path is in the set, and then it is a neighbour of the path's last node: left out here, it
        # changes no set found, and a weight every layer of a chain reads does not make every layer's
        # readers neighbours of each other.
        self.neighbours = [
            frozenset((set(structure.producers[n]) | consumers[n]
                       | {s for s in structure.siblings[n] if self._apart(n, s)}) & structure.free)
            for n in range(len(structure.producers))]
        self.seen: dict = {}  # frozenset -> admissible and convex

    def _apart(self, a: int, b: int) -> bool:
        """Whether no path between nodes a and b passes through a third node."""
        return not (self.desc[a] & self.anc[b] or self.desc[b] & self.anc[a])

    def ok(self, nodes: frozenset) -> bool:
        if nodes not in self.seen:
            allowed = self.admissible is None or self.admissible(nodes)
            self.seen[nodes] = convex(nodes, self.desc, self.anc) and allowed
        return self.seen[nodes]

    def grown(self, seed: int) -> list:
        """Sets containing `seed`, smallest first, at most per_seed of them."""
        found, layer = [frozenset([seed])], [frozenset([seed])]
        if not self.ok(found[0]):
            return [frozenset([seed])]  # a singleton always: every node must be placeable
        while layer and len(found) < self.limits.per_seed:
            layer = self._layer(layer, found, self.limits.per_seed - len(found))
            found.extend(layer)
        return found

    def _layer(self, layer: list, found: list, room: int) -> list:
        """The first `room` sets one neighbour larger than a set of `layer`, new, convex and admissible
        (only the sets kept are grown)."""
        nxt: list = []
        for nodes in layer:
            if len(nodes) >= self.limits.max_size:
                continue
            for n in sorted(set().union(*(self.neighbours[m] for m in nodes)) - nodes):
                bigger = nodes | {n}
                if bigger not in nxt and bigger not in found and self.ok(bigger):
                    nxt.append(bigger)
                    if len(nxt) == room:
                        return nxt
        return nxt

    def feeding(self, owned: frozenset) -> frozenset:
        """The recomputable nodes feeding `owned` from at most `depth` producer steps up, through each other."""
        out: set = set()
        frontier = set(owned)
        for _ in range(self.limits.depth):
            frontier = {p for n in frontier for p in self.s.producers[n]
                        if p in self.s.recomputable and p not in owned and p not in out}
            out |= frontier
        return frozenset(out)


def enumerate_candidates(structure: Structure, admissible=None, limits: SearchLimits = SearchLimits()) -> list:
    """(owned, recomputed) pairs of frozensets, each owned set convex, connected and admissible
    (`admissible(nodes)`; None: every set; a singleton is always listed), without duplicates."""
    e = _Enumeration(structure, admissible, limits)
    out: dict = {}
    for seed in sorted(structure.free):
        for owned in e.grown(seed):
            out[(owned, frozenset())] = None
            extra = e.feeding(owned)
            if extra and e.ok(owned | extra):
                out[(owned, extra)] = None
    return list(out)


def reads(structure: Structure, owned: frozenset, recomputed: frozenset) -> frozenset:
    """The free nodes a group reads from memory."""
    inside = owned | recomputed
    return frozenset(p for n in inside for p in structure.producers[n] if p not in inside and p in structure.free)
