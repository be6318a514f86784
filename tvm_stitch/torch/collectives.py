"""Graphs with torch.distributed's functional collectives: split at each collective, the parts between on TVM.

DDP under compiled autograd (`optimize_ddp = "python_reducer"`), and
other traced distributed code, give graphs that hold
`_c10d_functional` ops: `all_reduce` (or `all_gather_into_tensor`,
`reduce_scatter_tensor`, ...) issues a collective and returns at once,
`wait_tensor` waits for its result. TVM cannot run them; they are
planned split points, run by torch between the parts built on TVM:

1. each wait is moved down to just before the first node that reads its
   result, each issue up to just after the last of its inputs is
   computed: a gradient's all-reduce is issued as soon as the gradient
   exists, and the backward computes on while it travels;
2. where DDP asked for fused communication (its python reducer sets
   `torch._inductor.config._fuse_ddp_communication` and the bucket size
   in MB), consecutive all-reduces of one dtype, reduction and group are
   bucketed: their inputs flattened and concatenated, one all-reduce,
   one wait, the result sliced back;
3. the graph is cut at every collective: each run of other ops between
   two collectives is one part, built by the backend (and run under a
   profiler range `tvm_stitch: part N`), each collective a call of its
   own op.
"""

from __future__ import annotations

import operator

from tvm_stitch.torch.eager import Boxed

NAMESPACE = "_c10d_functional"
MEGABYTE = 1024 * 1024


def is_collective(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == NAMESPACE


def _is_wait(node) -> bool:
    return is_collective(node) and node.target._opname == "wait_tensor"


def has_collectives(graph) -> bool:
    return any(is_collective(n) for n in graph.nodes)


def split_at_collectives(gm, build):
    """A boxed callable running `gm` as parts built by `build(part, example_inputs)` with its collectives
    between them, run by torch; `gm` is reordered and bucketed in place first."""
    schedule(gm.graph)
    bucket_size = _fused_bucket_bytes()
    if bucket_size:
        bucket_all_reduces(gm.graph, bucket_size)
    gm.graph.lint()
    return Boxed(_split(gm, build))


def schedule(graph) -> None:
    """What reads a collective's result after everything else, the waits first (one part, not one per wait,
    reads them); issues as early as their inputs allow."""
    waited = set()
    for node in graph.nodes:
        if _is_wait(node) or any(a in waited for a in node.all_input_nodes):
            waited.add(node)
    output = next(n for n in graph.nodes if n.op == "output")
    for node in [n for n in graph.nodes if n in waited]:
        output.prepend(node)
    _place_after_inputs(graph, [n for n in graph.nodes if is_collective(n) and not _is_wait(n)])
    first_waited = next((n for n in graph.nodes if n in waited), None)
    if first_waited is not None:
        _place_after_inputs(graph, [n for n in reversed(graph.nodes) if _is_wait(n)], first_waited.prev)


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _place_after_inputs(graph, nodes: list, floor=None) -> None:
    """Each of `nodes` moved up to just after the last node it reads (after the placeholders, and `floor`, at
    least)."""
    for node in nodes:
        position = _position(graph)
        anchors = node.all_input_nodes + [n for n in graph.nodes if n.op == "placeholder"] + [floor] * bool(floor)
        if anchors:
            max(anchors, key=position).append(node)


def _fused_bucket_bytes() -> int:
    """DDP's bucket size where its python reducer asked for fused all-reduces, else 0."""
    import torch._inductor.config as inductor_config

    if not getattr(inductor_config, "_fuse_ddp_communication", False):
        return 0
    return int(float(getattr(inductor_config, "_fuse_ddp_bucket_size", 25)) * MEGABYTE)


def bucket_all_reduces(graph, bucket_bytes: int) -> None:
    """Consecutive all-reduces of one (reduction, group, dtype), up to `bucket_bytes` each bucket, as one."""
    bucket, key, size = [], None, 0
    for node in [n for n in graph.nodes if is_collective(n) and n.target._opname == "all_reduce"]:
        value = node.args[0].meta.get("val")
        node_key = (node.args[1:], getattr(value, "dtype", None))
        nbytes = value.numel() * value.element_size() if value is not None else bucket_bytes + 1
        if bucket and (node_key != key or size + nbytes > bucket_bytes or value is None):
            _fuse(graph, bucket)
            bucket, size = [], 0
        bucket.append(node)
        key, size = node_key, size + nbytes
    _fuse(graph, bucket)


def _fuse(graph, bucket: list) -> None:
    """One all-reduce of the flattened, concatenated inputs of `bucket`, its result sliced back for each
    member's wait; issued where the last member was, waited where the first wait was."""
    import torch

    waits = [next((u for u in n.users if _is_wait(u)), None) for n in bucket]
    if len(bucket) < 2 or None in waits or min(map(_position(graph), waits)) < _position(graph)(bucket[-1]):
        return
    aten = torch.ops.aten
    shapes = [list(n.args[0].meta["val"].shape) for n in bucket]
    sizes = [n.args[0].meta["val"].numel() for n in bucket]
    with graph.inserting_after(bucket[-1]):
        flat = [_call(graph, aten.reshape.default, (n.args[0], [-1])) for n in bucket]  # any layout
        joined = _call(graph, aten.cat.default, (flat,))
        reduced = _call(graph, bucket[-1].target, (joined, *bucket[-1].args[1:]))
    first_wait = min(waits, key=_position(graph))
    with graph.inserting_before(first_wait):
        waited = _call(graph, first_wait.target, (reduced,))
        start = 0
        for wait, shape, size in zip(waits, shapes, sizes):
            piece = _call(graph, aten.slice.Tensor, (waited, 0, start, start + size))
            wait.replace_all_uses_with(_call(graph, aten.view.default, (piece, shape)))
            start += size
    for node in waits + bucket:
        graph.erase_node(node)
    _place_after_inputs(graph, [*flat, joined, reduced])


def _call(graph, target, args):
    """A new node, its `val` (a fake tensor) computed from its inputs' as the other nodes' are."""
    from torch.fx.node import map_arg

    node = graph.call_function(target, args)
    node.meta["val"] = target(*map_arg(args, lambda a: a.meta["val"]))
    return node


def _split(gm, build):
    """A GraphModule calling, in `gm`'s order, one built part per run of non-collective ops (where the run's
    last op was), and the collectives."""
    import torch.fx as fx

    runs = _runs(gm.graph)
    run_of = {n: i for i, run in enumerate(runs) for n in run}
    later_readers = {n for run in runs for n in run if any(run_of.get(u) != run_of[n] for u in n.users)}
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in run_of and node is not runs[run_of[node]][-1]:
            continue
        if node not in run_of:
            env[node] = graph.node_copy(node, env.__getitem__)
            continue
        run = runs[run_of[node]]
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if run_of.get(a) != run_of[node]))
        outputs = [n for n in run if n in later_readers]
        if not outputs:
            continue
        name = f"part_{run_of[node]}"
        gm.add_submodule(name, _built_part(_part(gm, run, inputs, outputs), inputs, build, name))
        call = graph.call_module(name, tuple(env[a] for a in inputs))
        for index, out in enumerate(outputs):
            env[out] = graph.call_function(operator.getitem, (call, index))
            env[out].meta = dict(out.meta)
    return fx.GraphModule(gm, graph)


def _runs(graph) -> list:
    """The runs of call_function nodes between collectives, in order."""
    runs, current = [], []
    for node in graph.nodes:
        if node.op == "call_function" and not is_collective(node):
            current.append(node)
        elif current and is_collective(node):
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _part(gm, run, inputs, outputs):
    """The GraphModule of one run: `inputs` as placeholders, `outputs` as a tuple."""
    import torch.fx as fx

    graph, env = fx.Graph(), {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph)


def _built_part(part, inputs, build, name):
    import torch

    built = build(part, [a.meta["val"] for a in inputs])

    class BuiltPart(torch.nn.Module):
        def forward(self, *args):
            with torch.profiler.record_function(f"tvm_stitch: {name}"):
                return tuple(built(list(args)))

    return BuiltPart()
