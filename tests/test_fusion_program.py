"""The fusion search's integer program against exhaustive enumeration, and its acyclicity cuts."""

import itertools
import random

import pytest

from tvm_stitch.grouping.acyclic import quotient_cycle
from tvm_stitch.grouping.candidate_groups import SearchLimits, Structure, enumerate_candidates, reads
from tvm_stitch.grouping.fusion_program import Candidate, Problem, solve


def _runs(problem: Problem, chosen: list) -> bool:
    """Whether the chosen candidates (with the fixed nodes) are a plan that runs, checked by executing
    it: a unit runs once every value it reads from memory is there."""
    free, cands = problem.free, [problem.candidates[c] for c in chosen]
    owners = [u for c in cands for u in c.owned]
    if len(owners) != len(set(owners)) or not problem.must <= set(owners):
        return False
    if any(not c.reads <= set(owners) for c in cands):
        return False
    fixed = [n for n in range(len(problem.producers)) if n not in free]
    if any(p in free and p not in owners for n in fixed for p in problem.producers[n]):
        return False
    needs = [set(c.reads) | {p for n in c.owned | c.recomputed for p in problem.producers[n]
                             if p not in free and p not in c.owned | c.recomputed}
             | (set(c.recomputed) & set(owners) - c.owned) for c in cands]
    needs += [set(problem.producers[n]) for n in fixed]
    gives = [set(c.owned) for c in cands] + [{n} for n in fixed]
    done, ready, progress = [False] * len(gives), set(), True
    while progress:
        progress = False
        for k, need in enumerate(needs):
            if not done[k] and need <= ready:
                done[k], progress = True, True
                ready |= gives[k]
    return all(done)


def _exhaustive(problem: Problem) -> float:
    best = float("inf")
    n = len(problem.candidates)
    for size in range(n + 1):
        for chosen in itertools.combinations(range(n), size):
            cost = sum(problem.candidates[c].cost for c in chosen)
            if cost < best and _runs(problem, list(chosen)):
                best = cost
    return best


def _random_problem(rng: random.Random) -> Problem:
    n = rng.randint(3, 7)
    producers = tuple(frozenset(p for p in range(i) if rng.random() < 0.4) for i in range(n))
    free = frozenset(i for i in range(n) if rng.random() < 0.85)
    consumers = [{c for c in range(n) if i in producers[c]} for i in range(n)]
    recomputable = frozenset(i for i in free if rng.random() < 0.5)
    siblings = tuple(frozenset(j for j in range(n) if j != i and producers[i] & producers[j]) for i in range(n))
    structure = Structure(producers, free, recomputable, siblings)
    refused = {frozenset(s) for s in itertools.combinations(sorted(free), 2) if rng.random() < 0.2}
    pairs = enumerate_candidates(structure, lambda nodes: not any(r <= nodes for r in refused),
                                 SearchLimits(max_size=3, per_seed=4, depth=1))
    pairs = pairs[:14]
    singles = {next(iter(o)) for o, r in pairs if len(o) == 1 and not r}
    pairs += [(frozenset([u]), frozenset()) for u in sorted(free - singles)]
    cands = tuple(Candidate(o, r, reads(structure, o, r), round(rng.uniform(1, 10) + len(r) * rng.uniform(0, 3), 3))
                  for o, r in pairs)
    must = frozenset(u for u in free if not consumers[u] or any(c not in free for c in consumers[u]))
    return Problem(producers, free, must, cands)


def _check(seed: int) -> None:
    problem = _random_problem(random.Random(seed))
    solution = solve(problem, time_limit=20)
    best = _exhaustive(problem)
    assert solution is not None and solution.proven
    assert _runs(problem, list(solution.chosen))
    assert solution.cost == pytest.approx(best), seed


@pytest.mark.parametrize("seed", range(12))
def test_optimum_equals_exhaustive_enumeration(seed):
    _check(seed)


@pytest.mark.slow
def test_optimum_equals_exhaustive_enumeration_on_200_graphs():
    for seed in range(1000, 1200):
        _check(seed)


def test_two_convex_groups_waiting_for_each_other_are_a_cycle():
    # a -> b, c -> d: {a, d} and {b, c} are each convex, and each reads the other's result
    producers = (frozenset(), frozenset({0}), frozenset(), frozenset({2}))
    free = frozenset(range(4))
    ad = Candidate(frozenset({0, 3}), frozenset(), frozenset({2}), 1.0)
    bc = Candidate(frozenset({1, 2}), frozenset(), frozenset({0}), 1.0)
    assert quotient_cycle(producers, free, [ad, bc]) == [0, 1]
    singles = [Candidate(frozenset({u}), frozenset(), producers[u], 1.5) for u in range(4)]
    problem = Problem(producers, free, frozenset({1, 3}), (ad, bc, *singles))
    solution = solve(problem)
    # both pairs (2.0) cycle; one pair with the other two nodes alone (4.0) is the optimum
    assert solution.cuts == 1 and solution.cost == pytest.approx(4.0) and len(solution.chosen) == 3


def test_cycle_through_a_fixed_node_is_cut():
    # a -> F (fixed) -> b and c -> d: {a, c} then F then {b, d} runs; {a, d} with {b, c} does not
    producers = (frozenset(), frozenset({4}), frozenset(), frozenset({2}), frozenset({0}))
    free = frozenset(range(4))
    ad = Candidate(frozenset({0, 3}), frozenset(), frozenset({2}), 1.0)
    bc = Candidate(frozenset({1, 2}), frozenset(), frozenset(), 1.0)
    assert quotient_cycle(producers, free, [ad, bc]) is not None
    ac = Candidate(frozenset({0, 2}), frozenset(), frozenset(), 1.5)
    bd = Candidate(frozenset({1, 3}), frozenset(), frozenset({2}), 1.5)
    problem = Problem(producers, free, frozenset({0, 1, 3}), (ad, bc, ac, bd))
    solution = solve(problem)
    assert solution.chosen == (2, 3) and solution.proven


def test_a_value_recomputed_by_every_reader_is_not_written():
    # p -> r1, p -> r2: both readers recompute p, nothing launches p
    producers = (frozenset(), frozenset({0}), frozenset({0}))
    free = frozenset(range(3))
    cands = (Candidate(frozenset({0}), frozenset(), frozenset(), 5.0),
             Candidate(frozenset({1}), frozenset(), frozenset({0}), 4.0),
             Candidate(frozenset({2}), frozenset(), frozenset({0}), 4.0),
             Candidate(frozenset({1}), frozenset({0}), frozenset(), 5.0),
             Candidate(frozenset({2}), frozenset({0}), frozenset(), 5.0))
    solution = solve(Problem(producers, free, frozenset({1, 2}), cands))
    assert solution.chosen == (3, 4) and solution.cost == pytest.approx(10.0)
