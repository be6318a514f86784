"""What TVM cannot take runs on PyTorch eager, with one warning naming the op and the module path.

A graph with ops the importer has no converter for is split
(torch.fx's CapabilityBasedPartitioner): the runs of importable ops are
built on TVM, each unsupported op stays an eager call between them. A
graph that fails as a whole (a converter or the build raising, a device
or size TVM cannot take) runs on eager whole.
"""

from __future__ import annotations

import warnings

from tvm_stitch.torch.errors import CannotBuild
from tvm_stitch.torch.nodes import module_path, op_name


class EagerFallbackWarning(UserWarning):
    """A graph, or part of one, runs on PyTorch eager instead of TVM."""


def warn_eager(message: str) -> None:
    warnings.warn(f"tvm_stitch: {message}", EagerFallbackWarning, stacklevel=2)


def _describe(err) -> str:
    op, where = getattr(err, "op", ""), getattr(err, "where", "")
    head = f"{op} in {where}" if op and where else "a graph"
    return f"{head} runs on PyTorch eager ({err})"


class Boxed:
    """A graph module with aot_autograd's boxed calling convention (it empties `args`)."""

    def __init__(self, gm):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class's
        self.gm = gm

    def __call__(self, args: list):
        inputs = list(args)
        args.clear()
        return self.gm(*inputs)


class EagerFallback(Boxed):
    """The graph's own forward, boxed; warns once when made."""

    def __init__(self, gm, reason):
        super().__init__(gm)
        warn_eager(_describe(reason))


def split_unsupported(gm, example_inputs, eager_ops: set, build, fallback):
    """`gm` with the ops named in `eager_ops` on eager, the runs of other ops built by `build(part, inputs)`.

    `fallback(gm, reason)` is called where no part can be built.
    """
    import copy

    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    class Importable(OperatorSupportBase):
        def is_node_supported(self, submodules, node) -> bool:
            return node.op == "call_function" and op_name(node) not in eager_ops

    eager = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n) in eager_ops]
    listed = "; ".join(sorted({f"{op_name(n)} in {module_path(n)}" for n in eager}))
    split = copy.deepcopy(gm)
    partitioner = CapabilityBasedPartitioner(split, Importable(), allows_single_node_partition=True)
    split = partitioner.fuse_partitions(partitioner.propose_partitions())
    failed = _build_parts(split, build)
    if failed == _part_count(split):
        return fallback(gm, CannotBuild(f"TVM's importer cannot convert: {listed}"))
    warn_eager(f"{listed} runs on PyTorch eager (TVM's importer cannot convert it); the rest of the graph runs on "
               "TVM" + (f", but for {failed} part(s) that failed to build" if failed else ""))
    return Boxed(split)


def _part_count(split) -> int:
    return sum(1 for n in split.graph.nodes if n.op == "call_module")


def _build_parts(split, build) -> int:
    """Replace each fused submodule of `split` by its TVM build; the number that failed to build."""
    failed = 0
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        part = getattr(split, node.target)
        single = _outputs_as_tuple(part)
        try:
            built = build(part, [a.meta["val"] for a in node.args])
        except CannotBuild:
            failed += 1
            continue
        setattr(split, node.target, _module(built, single))
    return failed


def _outputs_as_tuple(part) -> bool:
    """Make a part return a tuple; whether it returned a single value."""
    output = next(n for n in part.graph.nodes if n.op == "output")
    single = not isinstance(output.args[0], (tuple, list))
    if single:
        output.args = ((output.args[0],),)
        part.recompile()
    return single


def _module(built, single):
    import torch

    class BuiltPart(torch.nn.Module):
        def forward(self, *args):
            out = built(list(args))
            return out[0] if single else tuple(out)

    return BuiltPart()
