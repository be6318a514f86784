"""The groups of one dataflow block: partitioned (greedy) or searched, each made a kernel, packed, put in place.

Greedy's groups are built first (a group whose rows may be split is retried as its parts that keep rows
on chip; one that recomputes producers, without them); with `fusion="search"` the fusion search may
replace them by a cheaper plan over the block with FuseOps' groups opened. The grouping decides
(grouping/), the kernel maker makes kernels, packing chooses launches (kernels/packing.py); this
module only puts their answers together and records them in the outcome.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from tvm_stitch.analysis.graph import Graph, build_graph
from tvm_stitch.grouping.fusion_search import greedy_groups, greedy_price, search_block, settled
from tvm_stitch.grouping.group_pricing import estimated_plan, plan_cost
from tvm_stitch.grouping.partition import partition, recomputed_in, recomputed_producers
from tvm_stitch.grouping.unfuse import opened_block
from tvm_stitch.kernels.builds import check_builds
from tvm_stitch.kernels.packing import pack_block, packed_kernels
from tvm_stitch.kernels.timed_packing import pack_in_time
from tvm_stitch.planning.limits import partition_limits
from tvm_stitch.planning.reasons import reason_of
from tvm_stitch.stitch.bindings import (call_bindings, defined, only_reshapes, still_read, topological_units,
                                        without_unused)
from tvm_stitch.stitch.budget import FunctionBudget
from tvm_stitch.stitch.kernel_maker import KernelMaker
from tvm_stitch.stitch.records import Attempt, Block, Outcome, StitchError, make_group


class BlockRewriter:
    """Rewrites blocks with `maker`'s kernels, recording every final attempt in `outcome`."""

    def __init__(self, maker: KernelMaker, fusion: str, seconds: tuple, analyses: dict):
        self.maker = maker
        self.target = maker.target
        self.fusion = fusion  # "greedy": partition.py's groups; "search": fusion_search.py's plan
        self.search_seconds = seconds[0]  # the search's time limit per dataflow block
        self.budget = FunctionBudget(seconds[1])  # past it, a function's blocks keep greedy's plans
        self.analyses = analyses
        spec = maker.target.spec
        self.limits = partition_limits(spec)  # what the partition may group, for every block
        # CUDA: the partition that keeps every row on chip, whose groups are the parts of a split one
        self.on_chip_limits = partition_limits(spec, split_long_rows=False) if maker.target.family == "cuda" else None
        self.outcome = Outcome(notes=maker.notes)

    def rewrite_block(self, function: str, block_index: int, block: relax.DataflowBlock, used_after: set,
                      calls: dict, bounds: dict) -> relax.DataflowBlock:
        graph = build_graph(self.maker.mod, block, used_after, self.analyses)
        self.outcome.opaque.extend((node.var.name, node.reason) for node in graph.nodes if not node.stitchable)
        scope = Block(function, graph, {b.var: (block_index, k) for k, b in enumerate(block.bindings)}, bounds,
                      recomputed_producers(graph, self.limits))
        greedy = partition(graph, self.limits)
        mark = self.outcome.mark()
        stitched = self._stitched_groups(scope, greedy)
        read = still_read(graph, scope.recomputed, stitched)
        for members in partition(graph, self.limits, among=read):
            if not only_reshapes(graph, members):
                stitched += self._kept([self.maker.attempt(scope, members)])
        if self.fusion == "search" and any(node.stitchable for node in graph.nodes):
            left = [n.index for n in graph.nodes if n.stitchable and n.ops and not only_reshapes(graph, [n.index])
                    and (n.index not in scope.recomputed or n.index in read)
                    and not any(n.index in a.group.members for a in stitched)]
            price = greedy_price(graph, self.target.spec, [a.kernel.plan for a in stitched], left)
            searched = self._searched(scope, block_index, (block, used_after, mark), (greedy, price, stitched))
            if searched is not None:
                stitched, scope = searched
        if not stitched:
            return block
        return relax.DataflowBlock(self._bindings(scope, stitched, used_after, calls))

    def _searched(self, fused: Block, block_index: int, where: tuple, greedy: tuple) -> tuple | None:
        """(stitched attempts, scope) of the fusion search's plan, over the block with FuseOps' groups of
        stitchable nodes opened (unfuse.py); None where greedy's plan, already built, stands (it cannot
        be beaten: fusion_search.settled; the search found nothing cheaper; or a group of its plan did
        not stitch). `where`: (the block, the variables later code reads, the outcome's mark before
        greedy's build); `greedy`: (greedy's groups of the block, greedy_price of its build, its stitched
        attempts: the kernels of those groups are priced already)."""
        block, used_after, mark = where
        partitioned, price, built = greedy
        spec = self.target.spec
        record = settled((fused.function, block_index), fused.graph, spec,
                         lambda node: only_reshapes(fused.graph, [node]), price)
        if record is not None:
            self.outcome.searches.append(record)
            return None
        left = self.budget.left()
        if left <= 0:
            self.budget.overrun((fused.function, block_index), price, self.outcome)
            return None
        opened, origin = opened_block(self.maker.mod, block, {n.var for n in fused.graph.nodes if n.stitchable})
        graph = build_graph(self.maker.mod, opened, used_after, self.analyses)
        scope = dataclasses.replace(fused, graph=graph, recomputed=frozenset(),
                                    where={b.var: (block_index, k) for k, b in enumerate(opened.bindings)})
        record, plan = search_block((scope.function, block_index), graph,
                                    (greedy_groups(fused.graph, self.limits, partitioned, (graph, origin)),
                                     self._known_costs(fused, partitioned, built)), spec,
                                    (self._candidate(scope), self._estimate(scope)),
                                    lambda node: only_reshapes(graph, [node]), min(self.search_seconds, left))
        self.outcome.searches.append(record)
        if plan is None:
            return None
        attempts = [self.maker.attempt(scope, list(owned), recomputed) for owned, recomputed in plan.groups]
        if not all(a.stitched for a in attempts):
            self.outcome.searches[-1] = dataclasses.replace(record, method="greedy", chosen_us=record.greedy_us,
                                                            why="a group of the searched plan did not stitch")
            return None
        self.outcome.rollback(mark)
        self.outcome.notes.extend(note for a in attempts for note in a.kernel.notes)
        self.outcome.notes.extend(plan.notes)
        return self._kept(attempts), dataclasses.replace(scope, recomputed=plan.copies_only)

    def _known_costs(self, fused: Block, partitioned: list, built: list) -> tuple:
        """Per group of greedy's partition, the cost of the kernel already built for it (None where the
        group was built otherwise: with other recomputed producers, or not at all)."""
        by_members = {a.group.members: a for a in built}
        known = []
        for members in partitioned:
            a = by_members.get(tuple(members))
            same = a is not None and a.group.recomputed == tuple(recomputed_in(fused.graph, members, fused.recomputed))
            known.append(plan_cost(a.kernel.plan, self.target.spec) if same else None)
        return tuple(known)

    def _candidate(self, scope: Block):
        """attempt(owned, recomputed) for the search: a candidate that fails is no candidate (strict too)."""
        def attempt(owned: list, recomputed: list) -> Attempt:
            try:
                return self.maker.attempt(scope, owned, tuple(recomputed))
            except StitchError as err:
                return Attempt(make_group(scope, owned, tuple(recomputed)), "", reason=reason_of(err))
        return attempt

    def _estimate(self, scope: Block):
        def estimate(owned: list, recomputed: list):
            return estimated_plan(self.maker.mod, scope.graph, owned, recomputed, scope.bounds, self.target.spec,
                                  self.target.target, self.maker.memo)
        return estimate

    def _kept(self, attempts: list) -> list:
        """Record the final attempts of groups; the stitched ones."""
        self.outcome.attempts.extend(attempts)
        return [a for a in attempts if a.stitched]

    def _stitched_groups(self, scope: Block, partitioned: list) -> list:
        """The stitched attempts of the partition's groups; a group that fails and whose rows may be
        split is retried as its parts that keep rows on chip (see `_groups`)."""
        stitched = []
        for members, parts in self._groups(scope.graph, partitioned):
            if only_reshapes(scope.graph, members):
                continue  # TVM turns these into views that launch nothing
            whole = self._recomputing(scope, members)
            if whole.stitched or not parts:
                stitched += self._kept([whole])
                continue
            self.outcome.notes.append(f"[{','.join(whole.group.ops)}] stitched as {len(parts)} groups with rows "
                                      f"kept on chip: {whole.reason.text}")
            stitched += self._kept([self._recomputing(scope, part) for part in parts])
        return stitched

    def _recomputing(self, scope: Block, members: list) -> Attempt:
        """The attempt of a group with the recomputed producers it reads; where that fails, of the
        group alone (the producers then keep their own launch)."""
        copies = recomputed_in(scope.graph, members, scope.recomputed)
        attempt = self.maker.attempt(scope, members, copies)
        if attempt.stitched or not copies:
            return attempt
        self.outcome.notes.append(f"[{','.join(attempt.group.ops)}] stitched reading "
                                  f"[{','.join(attempt.group.recomputed_ops)}] instead of recomputing it: "
                                  f"{attempt.reason.text}")
        return self.maker.attempt(scope, members)

    def _groups(self, graph: Graph, groups: list) -> list:
        """(group, parts) pairs of the partition's `groups`: a group whose rows may be split (see
        partition_limits) has as parts the groups that keep rows on chip, tried when the group itself
        cannot be stitched."""
        if self.on_chip_limits is None:
            return [(g, []) for g in groups]
        on_chip = partition(graph, self.on_chip_limits)
        out = []
        for members in groups:
            parts = [p for p in on_chip if set(p) <= set(members)]
            complete = sum(len(p) for p in parts) == len(members) and len(parts) > 1
            out.append((members, parts if complete else []))
        return out

    def _bindings(self, scope: Block, stitched: list, used_after: set, calls: dict) -> list:
        """The block's bindings with each stitched group one call, in an order that respects every
        dependence, less the recomputed producers nothing reads, with independent kernels packed."""
        graph = scope.graph
        by_first = {a.group.members[0]: a for a in stitched}
        bindings = []
        for unit in topological_units(graph, [list(a.group.members) for a in stitched]):
            attempt = by_first.get(unit[0])
            if attempt is not None and list(attempt.group.members) == unit:
                bindings.extend(call_bindings(attempt.kernel.name, attempt.outlined, calls))
                continue
            node = graph.nodes[unit[0]]
            bindings.append(node.binding)
            bindings.extend(node.aliases)
        droppable = {v for r in scope.recomputed for v in defined(graph.nodes[r])}
        bindings = without_unused(bindings, droppable, used_after)
        kernels = self._packable_kernels(bindings)
        try:
            return pack_block(bindings, kernels, calls, self.outcome.packs,
                              lambda func: check_builds(func, self.target.target),
                              self._pack_in_time if self.target.builds_cuda else None)
        except Exception as err:  # noqa: BLE001 - packing is an optimisation: keep the kernels apart
            if self.maker.strict:
                raise StitchError(f"cannot pack independent kernels: {err}") from err
            self.outcome.notes.append(f"independent kernels left unpacked: {type(err).__name__}: {err}")
            return bindings

    def _packable_kernels(self, bindings: list) -> dict:
        """name -> (PrimFunc, plan) of the kernels packing may share launches among (packing.packed_kernels);
        a column-split kernel whose walk packing takes is that walk from now on."""
        made = self.maker.kernels
        kernels, taken = packed_kernels(bindings, {name: (k.func, k.plan) for name, k in made.items()},
                                        {name: (k.func, k.plan) for name, k in self.maker.walks.items()})
        for name in taken:
            made[name] = self.maker.walks.pop(name)
        return kernels

    def _pack_in_time(self, func: tvm.tirx.PrimFunc, plans: list) -> bool:
        if pack_in_time(func, plans, self.target.spec):
            return True
        self.outcome.notes.append(f"time model: {', '.join(p.kernel for p in plans)} left unpacked (slower packed)")
        return False
