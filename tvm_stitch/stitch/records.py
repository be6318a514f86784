"""What the stitch pass records: a group of bindings, the kernel made of it, one attempt at it, a block being
rewritten, and the outcome the report is built from (plain data, made by kernel_maker and block_rewriter)."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm

from tvm_stitch.analysis.graph import Graph
from tvm_stitch.kernels.outline import Outlined
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.reasons import Reason
from tvm_stitch.report import GroupRecord, StitchReport


@tvm.error.register_error
class StitchError(RuntimeError):
    """Raised in strict mode when a group cannot be stitched.

    Registered with TVM so that it keeps its type when it crosses the FFI
    boundary of a pass.
    """


@dataclass(frozen=True)
class Group:
    """A group of bindings the partition chose, as the report names it."""

    function: str  # the Relax function holding the group
    members: tuple  # graph node indices
    bindings: tuple  # names of the Relax variables the group computes
    positions: tuple  # (dataflow block index, binding index) of each binding
    ops: tuple  # names of the legalized operators in the group
    op_kinds: tuple  # their classification
    recomputed: tuple  # graph nodes of the producers the kernel computes again
    recomputed_ops: tuple  # their operators


@dataclass(frozen=True)
class Kernel:
    """A scheduled stitched PrimFunc and its plan."""

    name: str
    plan: StitchPlan
    func: tvm.tirx.PrimFunc  # scheduled, with its plan attached
    notes: tuple = ()  # what the report says of how it was made
    variants: tuple = ()  # planning.variants.Variant chosen at run time before `plan` (kernels/variants.py)


OUTLINED, PLANNED, SCHEDULED = "outlined", "planned", "scheduled"
FUSION_METHODS = ("greedy", "search")
DEFAULT_FUSION = "search"  # the grouping a pipeline uses unless told otherwise (docs/fusion-search.md)


@dataclass(frozen=True)
class Attempt:
    """One try at stitching a group: `reached` is the last stage that succeeded ("" when outlining
    failed); a scheduled attempt has its `kernel` and `outlined` call, a fallback its `reason`."""

    group: Group
    reached: str
    outlined: Outlined | None = None
    kernel: Kernel | None = None
    reason: Reason | None = None

    @property
    def stitched(self) -> bool:
        return self.kernel is not None

    def record(self, kernels: dict) -> GroupRecord:
        """The report's record; `kernels` (name -> Kernel) may hold a variant that replaced the kernel."""
        g = self.group
        kernel = kernels.get(self.kernel.name, self.kernel) if self.kernel else None
        return GroupRecord(function=g.function, bindings=g.bindings, positions=g.positions, ops=g.ops,
                           op_kinds=g.op_kinds, recomputed=g.recomputed_ops,
                           kernel=kernel.name if kernel else "",
                           plan=kernel.plan if kernel else None, reason=self.reason, stage=self.reached,
                           variants=_variant_pairs(kernel) if kernel else ())


def _variant_pairs(kernel: Kernel) -> tuple:
    """(condition on the sizes, plan) of each variant of `kernel`, the plan for every other size last."""
    if not kernel.variants:
        return ()
    return tuple((v.condition.text(), v.plan) for v in kernel.variants) + (("otherwise", kernel.plan),)


@dataclass
class Outcome:
    """What the pass has made so far, in order: the report is built from it at the end."""

    attempts: list = field(default_factory=list)  # the final Attempt of every group
    opaque: list = field(default_factory=list)  # (binding, reason) left to TVM's default path
    packs: list = field(default_factory=list)  # (packed kernel, member kernels)
    notes: list = field(default_factory=list)
    searches: list = field(default_factory=list)  # fusion_search.SearchRecord per block

    def mark(self) -> tuple:
        """Where the attempts and notes end now (see rollback)."""
        return len(self.attempts), len(self.notes)

    def rollback(self, mark: tuple) -> None:
        """Forget the attempts and notes recorded since `mark` (a block's greedy build the search replaces)."""
        del self.attempts[mark[0]:], self.notes[mark[1]:]

    def into(self, report: StitchReport, kernels: dict) -> None:
        """Fill `report`; `kernels` (name -> Kernel) are the kernels as finally built."""
        report.groups.extend(a.record(kernels) for a in self.attempts)
        report.opaque.extend(self.opaque)
        report.packs.extend(self.packs)
        report.notes.extend(self.notes)
        report.searches.extend(self.searches)


@dataclass(frozen=True)
class Block:
    """A dataflow block being rewritten: its graph, where each binding is, its sizes' bounds."""

    function: str
    graph: Graph
    where: dict  # binding variable -> (dataflow block index, binding index)
    bounds: dict  # bounds of the function's symbolic sizes (size_bounds)
    recomputed: frozenset  # producers the groups reading them compute again


def make_group(block: Block, members: list, recomputed: tuple = ()) -> Group:
    graph = block.graph
    nodes = [graph.nodes[m] for m in members]
    return Group(
        function=block.function,
        members=tuple(members),
        bindings=tuple(n.var.name for n in nodes),
        positions=tuple(block.where[n.var] for n in nodes),
        ops=tuple(graph.ops[i].name for n in nodes for i in n.ops),
        op_kinds=tuple(graph.ops[i].cls.describe() for n in nodes for i in n.ops),
        recomputed=tuple(recomputed),
        recomputed_ops=tuple(graph.ops[i].name for m in recomputed for i in graph.nodes[m].ops),
    )
