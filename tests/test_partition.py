"""Grouping: maximal convex memory-bound groups, compute-intensive ops left alone."""

from tvm import relax

from tvm_stitch.analysis.graph import analyses_for, build_graph
from tvm_stitch.grouping.partition import partition
from tvm_stitch.planning.limits import partition_limits
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.workloads import SUITE, dims

from conftest import CUDA, fused, make_module, tensor

op = relax.op
LIMITS = partition_limits(TargetSpec.from_target(CUDA))


def _graph(mod):
    mod = fused(mod)
    main = mod["main"]
    (block,) = main.body.blocks
    return build_graph(mod, block, set(relax.analysis.free_vars(main.body.body)), analyses_for(mod))


def _assert_convex(graph, groups):
    desc = graph.descendants()
    for members in groups:
        mask = sum(1 << m for m in members)
        for outside in range(len(graph.nodes)):
            if mask >> outside & 1:
                continue
            reached_from_group = any(desc[m] >> outside & 1 for m in members)
            reaches_group = desc[outside] & mask
            assert not (reached_from_group and reaches_group), (members, outside)


def test_layernorm_softmax_is_one_group():
    graph = _graph(SUITE["layernorm_softmax"].build("float32", dims("test")))
    groups = partition(graph, LIMITS)
    assert len(groups) == 1
    assert sorted(groups[0]) == [n.index for n in graph.nodes if n.stitchable]


def test_compute_intensive_ops_are_never_grouped():
    x, w, g, b = tensor("x", (64, 96)), tensor("w", (96, 96)), tensor("g", (96,)), tensor("b", (96,))

    def body(bb, x, w, g, b):
        mean = bb.emit(op.mean(x, axis=[-1], keepdims=True))
        h = bb.emit(op.subtract(x, mean))
        m = bb.emit(op.add(op.matmul(h, w), b))
        mx = bb.emit(op.max(m, axis=[-1], keepdims=True))
        return bb.emit(op.exp(op.subtract(m, mx)))

    graph = _graph(make_module([x, w, g, b], body))
    groups = partition(graph, LIMITS)
    for members in groups:
        for m in members:
            assert graph.nodes[m].stitchable
            for i in graph.nodes[m].ops:
                assert graph.ops[i].cls.kind.memory_bound
    opaque = [n for n in graph.nodes if not n.stitchable]
    assert any("contracts two tensors" in n.reason for n in opaque)
    _assert_convex(graph, groups)


def test_no_group_closes_a_cycle_through_a_matmul():
    # a feeds both the matmul and the final add: {a, final} would need the matmul inside.
    x, w = tensor("x", (64, 64)), tensor("w", (64, 64))

    def body(bb, x, w):
        a = bb.emit(op.sum(op.exp(x), axis=[-1], keepdims=True))
        scaled = bb.emit(op.divide(x, a))
        m = bb.emit(op.matmul(scaled, w))
        s = bb.emit(op.sum(m, axis=[-1], keepdims=True))
        return bb.emit(op.add(op.multiply(scaled, s), a))

    graph = _graph(make_module([x, w], body))
    groups = partition(graph, LIMITS)
    _assert_convex(graph, groups)
    assert len(groups) >= 2


def test_groups_are_convex_on_every_suite_graph():
    for graph_def in SUITE.values():
        graph = _graph(graph_def.build("float32", dims("test")))
        _assert_convex(graph, partition(graph, LIMITS))


def test_column_reduction_does_not_join_row_group():
    # Large enough that one row task for everything would starve the machine.
    x = tensor("x", (1024, 512))

    def body(bb, x):
        row = bb.emit(op.sum(x, axis=[1], keepdims=True))
        centered = bb.emit(op.subtract(x, row))
        return bb.emit(op.sum(op.multiply(centered, centered), axis=[0]))

    graph = _graph(make_module([x], body))
    groups = partition(graph, LIMITS)
    _assert_convex(graph, groups)
    column = [i for i, o in enumerate(graph.ops) if o.cls.reduce_where == "column"]
    row = [i for i, o in enumerate(graph.ops) if o.cls.reduce_where == "row"]
    node_of = {i: graph.ops[i].node for i in range(len(graph.ops))}
    for members in groups:
        assert not ({node_of[c] for c in column} & set(members) and {node_of[r] for r in row} & set(members))
