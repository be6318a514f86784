"""The fusion plan as an integer program: which candidate groups to launch, solved by HiGHS.

Plain data in (`Problem`), plain data out (`Solution`); nothing here knows
Relax. A problem's nodes are a dataflow block's bindings: *free* ones (the
stitchable nodes the search places) and *fixed* ones (opaque bindings, which
keep their own launch). A `Candidate` computes its `owned` nodes and writes
their results that anything outside reads, computes its `recomputed` nodes
for its own use only, and reads `reads` (free nodes' results) from memory.

Variables: x_c (candidate c is launched) and m_u (free node u's result is in
memory). Constraints:
- m_u = sum of x_c over the candidates owning u: a value in memory is written
  by exactly one launched group;
- x_c <= m_p for each p that c reads: what a group reads is in memory (a
  value nothing materialises is computed again inside each group reading it);
- m_u = 1 where a fixed node or later code reads u, or nothing inside the
  block does (its result is the block's output);
- the launched groups and the fixed nodes form an acyclic graph (acyclic.py):
  each cycle found in a solution is cut (its candidates are not all launched
  together) and the program solved again.
Objective: the sum of the launched candidates' costs (modeled microseconds).

`scipy.optimize.milp` (HiGHS) is used: the program is a small set-partitioning
program with linear side constraints, which HiGHS's branch and cut proves
optimal in milliseconds at these sizes, and scipy is already a dependency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from tvm_stitch.grouping.acyclic import quotient_cycle


@dataclass(frozen=True)
class Candidate:
    owned: frozenset  # free nodes it computes and writes where read outside
    recomputed: frozenset  # free nodes it computes for itself, writing nothing
    reads: frozenset  # free nodes whose results it reads from memory
    cost: float  # modeled microseconds (or the CPU proxy), >= 0


@dataclass(frozen=True)
class Problem:
    producers: tuple  # per node: the nodes whose results it reads
    free: frozenset  # nodes placed by the search; the others are fixed
    must: frozenset  # free nodes whose result must be in memory
    candidates: tuple  # Candidate


@dataclass(frozen=True)
class Solution:
    chosen: tuple  # indices into Problem.candidates, ascending
    cost: float
    proven: bool  # the optimum was proven (not stopped by the time limit)
    seconds: float
    cuts: int = 0  # cycles cut


def _rows(problem: Problem) -> tuple:
    """(matrix rows, lower bounds, upper bounds) of the constraints other than the cycle cuts."""
    cands = problem.candidates
    nodes = sorted(problem.free)
    m_index = {u: len(cands) + k for k, u in enumerate(nodes)}
    owners: dict = {u: {} for u in nodes}  # node -> {candidate owning it: 1.0}, in candidate order
    for c, cand in enumerate(cands):
        for u in cand.owned & problem.free:
            owners[u][c] = 1.0
    rows, lower, upper = [], [], []
    for u in nodes:
        row = owners[u]
        row[m_index[u]] = -1.0
        rows.append(row), lower.append(0.0), upper.append(0.0)
    for c, cand in enumerate(cands):
        for p in cand.reads:
            rows.append({c: 1.0, m_index[p]: -1.0}), lower.append(-np.inf), upper.append(0.0)
    return rows, lower, upper, m_index


def _matrix(rows: list, width: int):
    """The sparse constraint matrix of `rows` (column -> coefficient per row)."""
    count = sum(len(row) for row in rows)
    r = np.fromiter((i for i, row in enumerate(rows) for _ in row), dtype=np.int64, count=count)
    c = np.fromiter((k for row in rows for k in row), dtype=np.int64, count=count)
    v = np.fromiter((x for row in rows for x in row.values()), dtype=np.float64, count=count)
    return sparse.csr_array((v, (r, c)), shape=(len(rows), width))


def solve(problem: Problem, time_limit: float = 10.0, max_cuts: int = 200) -> Solution | None:
    """The cheapest acyclic choice of candidates; None when none is feasible or none was found in time."""
    start = time.perf_counter()
    cands = problem.candidates
    rows, lower, upper, m_index = _rows(problem)
    width = len(cands) + len(m_index)
    cost = np.concatenate([[c.cost for c in cands], np.zeros(len(m_index))])
    lo, hi = np.zeros(width), np.ones(width)
    for u in problem.must:
        lo[m_index[u]] = 1.0
    cuts = 0
    while True:
        left = time_limit - (time.perf_counter() - start)
        if left <= 0 or cuts > max_cuts:
            return None
        constraints = [LinearConstraint(_matrix(rows, width), lower, upper)] if rows else []
        result = milp(cost, integrality=np.ones(width), bounds=Bounds(lo, hi), constraints=constraints,
                      options={"time_limit": left})
        if result.x is None:
            return None
        chosen = tuple(c for c in range(len(cands)) if result.x[c] > 0.5)
        cycle = quotient_cycle(problem.producers, problem.free, [cands[c] for c in chosen])
        if cycle is None:
            total = float(sum(cands[c].cost for c in chosen))
            return Solution(chosen, total, result.status == 0, time.perf_counter() - start, cuts)
        rows.append({chosen[k]: 1.0 for k in cycle}), lower.append(-np.inf), upper.append(len(cycle) - 1.0)
        cuts += 1
