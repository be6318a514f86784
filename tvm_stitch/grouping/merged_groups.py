"""Candidates of the fusion search made of two of greedy's groups that read a common value.

Greedy's partition keeps a norm backward's row reductions (dx) and column
reductions (dgamma, dbeta) apart, and the enumeration (candidate_groups.py)
grows sets of at most `SearchLimits.max_size` nodes, fewer than their union
holds: each group's kernel reads x and dy. The union of two greedy groups
that share a read value and stay convex is offered to the search as one more
candidate; pricing plans it (the mix-order scheme plans row and column
reductions of the same rows together, planning/cuda/mix_order.py) and the
integer program takes it only where the model prices it below the pair.
A union past a group's limits (planning/limits.py: reductions, ops) is not
offered, so a long chain's candidates stay those of its length's groups
(compile time linear in the chain).
"""

from __future__ import annotations

from itertools import combinations

from tvm_stitch.grouping.candidate_groups import Structure, convex, reachability
from tvm_stitch.planning.limits import GROUP_OPS, GROUP_REDUCTIONS


def merged_pairs(structure: Structure, greedy: list) -> list:
    """(owned, recomputed) of the union of each pair of greedy's groups (as (owned, recomputed) sets)
    that read a common value, whose union is convex and within a group's limits (its nodes that may not
    be recomputed counted as reductions); what either recomputes and the union owns is owned, not
    recomputed."""
    desc, anc = reachability(structure.producers)
    merged = []
    for (owned_a, rec_a), (owned_b, rec_b) in combinations(greedy, 2):
        owned = owned_a | owned_b
        if len(owned) > GROUP_OPS or len(owned - structure.recomputable) > GROUP_REDUCTIONS:
            continue
        if not any(structure.siblings[u] & owned_b for u in owned_a) or not convex(owned, desc, anc):
            continue
        merged.append((frozenset(owned), frozenset((rec_a | rec_b) - owned)))
    return merged
