"""The fusion search of one dataflow block: candidates priced, the cheapest acyclic plan solved for.

FusionStitching's step after the greedy partition: enumerate candidate
groups (candidate_groups.py), price each as the kernel it would become
(group_pricing.py), and let the integer program (fusion_program.py) choose
which to launch: every node computed, every value read from memory written
by a launched group or computed again inside each reader, the launches
orderable, the total modeled time least. Greedy's partition is priced
first, exactly, and is the incumbent: a block whose greedy plan is already at
its bound (one launch moving only the bytes it must) is not searched; the
search's plan is used only where it is cheaper; where the search does not
finish in time (SEARCH_SECONDS per block, end to end: pricing and solves),
finds nothing, or a price is missing (symbolic sizes without bounds),
greedy's plan stands. A function whose compile time has passed
FUNCTION_SECONDS searches no further block: greedy's plans, built already,
are used (`over_budget`, said in the report).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from tvm import relax

from tvm_stitch.analysis.classify import OpKind
from tvm_stitch.analysis.graph import Graph
from tvm_stitch.grouping.candidate_groups import SearchLimits, Structure, enumerate_candidates, reads
from tvm_stitch.grouping.fusion_program import Candidate, Problem, solve
from tvm_stitch.grouping.merged_groups import merged_pairs
from tvm_stitch.grouping.group_pricing import Pricer, fallback_us, plan_cost, proxy_us, tensor_bytes
from tvm_stitch.grouping.partition import recomputed_in, recomputed_producers

SPATIAL = (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.INJECTIVE)
SEARCH_SECONDS = 10.0  # the search's time limit per dataflow block: pricing and solves
FUNCTION_SECONDS = 120.0  # a function's compile time after which its blocks are not searched
OVER_BUDGET = "the function's compile-time budget is spent"
OUT_OF_TIME = "no cheaper plan found in the time limit"
# candidates planned per block at most: one per PRICED_PER_GROUPS groups of greedy's, and PRICED_EXTRA more
# (greedy's groups are planned anyway: the budget keeps the search's compile time within a share of greedy's)
PRICED_PER_GROUPS, PRICED_EXTRA = 4, 6
GAIN = 1e-3  # the search's plan must be cheaper than greedy's by more than this share
AS_CHEAP = "greedy's plan is as cheap"
UNPRICED = "a kernel has no modeled cost (symbolic sizes without bounds)"
AT_BOUND = "greedy's plan is at the block's bound: one launch, compulsory bytes"
ONE_LAUNCH = "greedy's plan is one launch costing less than any two"
SLACK = 0.02  # greedy's plan within this share of the block's bound (bound_us) is not searched


@dataclass(frozen=True)
class SearchRecord:
    """What the report says of one block's search."""

    function: str
    block: int
    method: str  # "search" or "greedy" (the plan used)
    chosen_us: float  # modeled time of the plan used (-1: not priced)
    greedy_us: float  # of greedy's plan (-1: not priced)
    proven: bool  # the solver proved its plan optimal among the candidates
    seconds: float  # enumeration, pricing and solve
    candidates: int = 0
    why: str = ""  # why greedy's plan was kept


@dataclass(frozen=True)
class SearchedPlan:
    """The groups to stitch, (owned, recomputed) node tuples (the other nodes keep TVM's path)."""

    groups: tuple
    copies_only: frozenset  # nodes computed again by their readers and launched by none
    notes: tuple


def block_structure(graph: Graph, reshape_only, expensive_copies: bool = True) -> tuple:
    """(Structure, must): the free nodes are the stitchable ones; `must`: those whose result is read by
    a fixed node or later code, or by nothing in the block (its output). Element-wise, broadcast and
    injective nodes may be computed again, those with expensive intrinsics (exp, erf...) only where
    `expensive_copies` (CUDA, whose time model prices them; the CPU proxy prices traffic alone)."""
    n = len(graph.nodes)
    free = frozenset(node.index for node in graph.nodes if node.stitchable and node.ops)
    producers = tuple(frozenset(graph.producers[i]) for i in range(n))
    recomputable = frozenset(i for i in free if not reshape_only(i) and all(
        graph.ops[k].cls.kind in SPATIAL and (expensive_copies or not graph.ops[k].cls.expensive)
        for k in graph.nodes[i].ops))
    reads_of = [{ref for k in graph.nodes[i].ops for ref in graph.ops[k].inputs if ref.op not in graph.nodes[i].ops}
                for i in range(n)]
    siblings = tuple(frozenset(j for j in free if j != i and reads_of[i] & reads_of[j]) for i in range(n))
    consumers = graph.consumers
    must = frozenset(u for u in free if not consumers[u] or any(c not in free for c in consumers[u])
                     or any(k in graph.escapes for k in graph.nodes[u].ops))
    return Structure(producers, free, recomputable, siblings), must


def greedy_groups(graph: Graph, limits, partitioned: list, opened: tuple) -> list:
    """Greedy's groups (`partitioned`, partition.py's of `graph`) as (owned, recomputed) frozensets of
    the nodes of `opened`: (the graph of the block with FuseOps' groups opened, unfuse.py; its
    variables to the block's)."""
    copies = recomputed_producers(graph, limits)
    opened_graph, origin = opened
    node_of = {v: n.index for n in graph.nodes for v in [n.var] + [a.var for a in n.aliases]}
    parts: dict = {}
    for n in opened_graph.nodes:
        parts.setdefault(node_of[origin[n.var]], set()).add(n.index)
    return [(frozenset(i for m in members for i in parts[m]),
             frozenset(i for m in recomputed_in(graph, members, copies) for i in parts[m]))
            for members in partitioned]


def _priced(pairs: list, structure: Structure, pricer: Pricer, reshape_only, exact: bool = False,
            known: tuple = ()) -> tuple:
    """(candidates, stitched flags): the pairs that price; reshapes alone are views (free, left to TVM).
    `known`: per pair, the price of its kernel already built, or None (priced here)."""
    cands, stitched = [], []
    for k, (owned, rec) in enumerate(pairs):
        if not rec and all(reshape_only(u) for u in owned):
            cost, stitches = 0.0, False
        elif k < len(known) and known[k] is not None:
            cost, stitches = known[k], True
        else:
            cost, stitches = pricer.cost(owned, rec, exact)
        if cost is not None:
            cands.append(Candidate(owned, rec, reads(structure, owned, rec), cost))
            stitched.append(stitches)
    return cands, stitched


def _tensor_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_tensor_bytes(f) for f in ty.fields)
    return tensor_bytes(ty)


def bound_us(graph: Graph, structure: Structure, must: frozenset, spec, launches: int = 1) -> float:
    """What no plan of the block with `launches` launches goes below: the values it reads from outside
    read once and the results later code reads written once, at the sustainable bandwidth."""
    inputs = {ref for u in structure.free for k in graph.nodes[u].ops for ref in graph.ops[k].inputs if ref.op < 0}
    moved = sum(_tensor_bytes(getattr(graph.externals[ref.output], "ty", None)) for ref in inputs)
    moved += sum(_tensor_bytes(graph.nodes[u].var.ty) for u in must)
    return proxy_us(spec, moved, launches)


def greedy_price(graph: Graph, spec, plans: list, left: list) -> tuple:
    """(modeled us, -1 where a kernel has none; whether it is one launch computing every free node) of
    greedy's build of a block: `plans`, its stitched kernels' plans; `left`, the free nodes it leaves to
    TVM's default path (priced as group_pricing.fallback_us)."""
    costs = [plan_cost(plan, spec) for plan in plans]
    if any(c is None for c in costs):
        return -1.0, False
    whole = len(plans) == 1 and plans[0].kernels == 1 and not left
    return sum(costs) + sum(fallback_us(graph, n, spec) for n in left), whole


def settled(where: tuple, graph: Graph, spec, reshape_only, price: tuple) -> SearchRecord | None:
    """The record of a block whose greedy plan the search cannot beat, without opening or searching it;
    None where it may. `graph`: the block's (FuseOps' groups); `price`: greedy_price of its greedy build.
    Greedy's plan stands where a kernel has no modeled cost, where it is within SLACK of the block's
    bound, and (proven) where it is one launch computing every free node and costs no more than the
    bound of two launches: every other plan launches at least two kernels."""
    start = time.perf_counter()
    us, whole = price
    if us < 0:
        return SearchRecord(*where, "greedy", -1.0, -1.0, False, 0.0, 0, UNPRICED)
    structure, must = block_structure(graph, reshape_only)
    why, proven = "", False
    if us <= (1 + SLACK) * bound_us(graph, structure, must, spec):
        why = AT_BOUND
    elif whole and us <= bound_us(graph, structure, must, spec, launches=2):
        why, proven = ONE_LAUNCH, True
    return SearchRecord(*where, "greedy", us, us, proven, time.perf_counter() - start, 0, why) if why else None


def _plan(cands: list, stitched: list, chosen: tuple, graph: Graph) -> SearchedPlan:
    groups = tuple((tuple(sorted(cands[c].owned)), tuple(sorted(cands[c].recomputed))) for c in chosen if stitched[c])
    owned = {u for c in chosen for u in cands[c].owned}
    copied: dict = {}
    for c in chosen:
        for r in cands[c].recomputed:
            copied.setdefault(r, []).append(c)
    notes = []
    for r, where in sorted(copied.items()):
        name = ",".join(graph.ops[i].name for i in graph.nodes[r].ops)
        readers = "; ".join(",".join(graph.ops[i].name for u in sorted(cands[c].owned) for i in graph.nodes[u].ops)
                            for c in where)
        notes.append(f"[{name}] computed again in {len(where)} group(s) ([{readers}]): cheaper under the model than "
                     + ("writing it and reading it back" if r not in owned else "reading it there (it is also written, "
                                                                                "for its other readers)"))
    readers: dict = {}
    for c in chosen:
        for p in cands[c].reads:
            readers[p] = readers.get(p, 0) + 1
    for p, count in sorted(readers.items()):
        name = ",".join(graph.ops[i].name for i in graph.nodes[p].ops)
        notes.append(f"[{name}] written to memory and read by {count} group(s): computing it again in them "
                     "costs more under the model")
    return SearchedPlan(groups, frozenset(copied) - owned, tuple(notes))


def over_budget(where: tuple, price: tuple) -> SearchRecord:
    """The record of a block not searched: its function's compile time passed FUNCTION_SECONDS.
    `price`: greedy_price of its greedy build."""
    return SearchRecord(*where, "greedy", price[0], price[0], False, 0.0, 0, OVER_BUDGET)


def search_block(where: tuple, graph: Graph, greedy: tuple, spec, pricing: tuple, reshape_only,
                 time_limit: float, search_limits: SearchLimits = SearchLimits()) -> tuple:
    """(SearchRecord, SearchedPlan or None): the searched plan where it is cheaper than greedy's.
    `where`: (function, dataflow block index); `greedy`: (greedy's groups as (owned, recomputed) sets of
    `graph`'s nodes, per group the price of the kernel greedy's build made of it or None);
    `time_limit`: seconds from the call, pricing and solves included;
    `pricing`: (attempt, estimate) as group_pricing.Pricer takes them;
    `reshape_only(node)`: whether a node only reshapes (a view: nothing launched)."""
    start = time.perf_counter()
    function, block = where
    greedy, known = greedy
    structure, must = block_structure(graph, reshape_only, spec.family == "cuda")
    pricer = Pricer(graph, spec, *pricing, must)
    cands, stitched = _priced(greedy, structure, pricer, reshape_only, exact=True, known=known)
    greedy_us = sum(c.cost for c in cands)

    def kept(why: str, proven: bool = False) -> tuple:
        us = greedy_us if len(cands) >= len(greedy) and not pricer.unpriced else -1.0
        return SearchRecord(function, block, "greedy", us, us, proven, time.perf_counter() - start, len(cands),
                            why), None

    if pricer.unpriced:
        return kept(UNPRICED)
    if len(cands) < len(greedy):
        return kept("a group of greedy's falls back: its plan is not priced")
    if greedy_us <= (1 + SLACK) * bound_us(graph, structure, must, spec):
        return kept(AT_BOUND)
    taken = set(greedy)
    # Unions of greedy's groups (few: at most one per pair) are priced now, not lazily: the lazy budget,
    # spent on enumerated candidates of low bounds, left a float16 BatchNorm backward's whole group
    # (39.2 us against greedy's 50.7) unpriced.
    merged = [p for p in dict.fromkeys(merged_pairs(structure, greedy)) if p not in taken]
    unions, union_flags = _priced(merged, structure, pricer, reshape_only)
    others = [p for p in dict.fromkeys(enumerate_candidates(structure, limits=search_limits))
              if p not in taken and p not in merged]
    found = _priced_lazily(Problem(structure.producers, structure.free, must, tuple(cands + unions)),
                           stitched + union_flags, others,
                           functools.partial(lower_us, graph, must, spec, _sizes(graph)),
                           lambda o, r: _priced([(o, r)], structure, pricer, reshape_only),
                           (greedy_us * (1 - GAIN), start + time_limit,
                            len(greedy) // PRICED_PER_GROUPS + PRICED_EXTRA))
    if pricer.unpriced:
        return kept(UNPRICED)
    if isinstance(found, str):
        return kept(found, found == AS_CHEAP)
    solution, cands, stitched = found
    record = SearchRecord(function, block, "search", solution.cost, greedy_us, solution.proven,
                          time.perf_counter() - start, len(cands))
    return record, _plan(cands, stitched, solution.chosen, graph)


def _priced_lazily(problem: Problem, stitched: list, others: list, lower, price, limits: tuple):
    """(solution, candidates, stitched flags) of the cheapest plan, or why there is none cheaper than
    `limits[0]`, the solves and pricing ending by `limits[1]` (a time.perf_counter() deadline) and the
    pricing `limits[2]` candidates at most (a budget in candidates: within the deadline, the plan does
    not depend on the machine's load). `problem`
    holds the priced candidates; each of `others` enters at its lower bound and is priced
    (`price(owned, recomputed)`: ([Candidate] or [], [stitched])) only once a solution chooses it: a
    solution whose candidates are all priced is optimal, every other candidate costing at least its
    bound."""
    cands, stitched = list(problem.candidates), list(stitched)
    known = [True] * len(cands)
    for owned, rec in others:
        cands.append(Candidate(owned, rec, reads(problem, owned, rec), lower(owned, rec)))
        stitched.append(True)
        known.append(False)
    target, deadline, budget = limits
    while True:
        seconds = deadline - time.perf_counter()
        if seconds <= 0:
            return OUT_OF_TIME
        solution = solve(dataclasses.replace(problem, candidates=tuple(cands)), max(0.1, seconds))
        if solution is None:
            return "no plan found in the time limit"
        if solution.cost >= target:
            return AS_CHEAP if solution.proven else OUT_OF_TIME
        unknown = [c for c in solution.chosen if not known[c]]
        if not unknown:
            return solution, cands, stitched
        budget -= len(unknown)
        if budget < 0:
            return _best_priced(problem, stitched[:len(problem.candidates)], target, deadline)
        for c in sorted(unknown, reverse=True):
            if time.perf_counter() >= deadline:
                return OUT_OF_TIME
            priced, flags = price(cands[c].owned, cands[c].recomputed)
            if priced:
                cands[c], stitched[c], known[c] = priced[0], flags[0], True
            else:
                del cands[c], stitched[c], known[c]


def _best_priced(problem: Problem, stitched: list, target: float, deadline: float):
    """With the pricing budget spent: the cheapest plan of the candidates priced up front (greedy's
    groups and their unions) where it is cheaper than `target` (not proven), else why there is none."""
    solution = solve(problem, max(0.1, deadline - time.perf_counter()))
    if solution is None or solution.cost >= target:
        return "no cheaper plan within the pricing budget"
    return dataclasses.replace(solution, proven=False), list(problem.candidates), list(stitched)


def _sizes(graph: Graph) -> tuple:
    """(bytes of a value an op reads, bytes of a node's result, each computed once for the block; the
    nodes' consumers)."""
    refs, nodes = {}, {}

    def of_ref(r) -> int:
        if r not in refs:
            refs[r] = (_tensor_bytes(getattr(graph.externals[r.output], "ty", None)) if r.op < 0
                       else tensor_bytes(graph.ops[r.op].out_types[r.output]))
        return refs[r]

    def of_node(n: int) -> int:
        if n not in nodes:
            nodes[n] = _tensor_bytes(graph.nodes[n].var.ty)
        return nodes[n]
    return of_ref, of_node, graph.consumers


def lower_us(graph: Graph, must: frozenset, spec, sizes: tuple, owned: frozenset, recomputed: frozenset) -> float:
    """A bound below a group's modeled time: one launch, writing the results read outside it and reading
    once what its element-wise, broadcast and reduction ops read from outside (an injective op may read
    a part of its input). `sizes`: _sizes(graph)."""
    of_ref, of_node, consumers = sizes
    ops = {k for n in owned | recomputed for k in graph.nodes[n].ops}
    inputs = {ref for k in ops if graph.ops[k].cls.kind != OpKind.INJECTIVE
              for ref in graph.ops[k].inputs if ref.op not in ops}
    moved = sum(of_ref(r) for r in inputs)
    moved += sum(of_node(n) for n in owned if n in must or any(c not in owned for c in consumers[n]))
    return proxy_us(spec, moved, 1)
