"""The dataflow graph of one Relax dataflow block, as the partitioner sees it.

Each binding is a node. A node is *stitchable* when it is a `call_tir` of a
memory-intensive PrimFunc, or a call of a `Primitive` function (a FuseOps
group) all of whose `call_tir`s are memory-intensive. Everything else —
compute-intensive groups with their epilogues, library calls, shape code —
is opaque and keeps TVM's default handling. `TupleGetItem` bindings on a
stitchable node are aliases of that node, so they never cut a group.

Values are referred to by `ValueRef(op, output)`: output `output` of op `op`
(an index into `Graph.ops`), or by `ValueRef(-1, k)` for external value k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.classify import OpClass, OpKind, classify_primfunc
from tvm_stitch.analysis.row_alignment import RowInfo, analyze_rows


@dataclass(frozen=True)
class ValueRef:
    op: int  # index into Graph.ops, or -1 for an external value
    output: int  # output index of the op, or index into Graph.externals


@dataclass
class Op:
    """One call_tir inside a stitchable node."""

    node: int
    gv: tvm.ir.GlobalVar
    func: tirx.PrimFunc
    cls: OpClass
    rows: RowInfo
    inputs: list  # ValueRef per PrimFunc input parameter
    out_types: list  # relax TensorType per output

    @property
    def name(self) -> str:
        return self.gv.name_hint


@dataclass
class Node:
    index: int
    binding: relax.VarBinding
    stitchable: bool
    ops: list = field(default_factory=list)  # indices into Graph.ops
    aliases: list = field(default_factory=list)  # TupleGetItem bindings absorbed
    reason: str = ""  # why not stitchable

    @property
    def var(self) -> relax.Var:
        return self.binding.var


@dataclass
class Graph:
    nodes: list
    ops: list
    externals: list  # relax expressions defined outside the stitchable ops
    producers: list  # per node: set of producer node indices
    value_of: dict  # relax var -> ValueRef or tuple of ValueRef
    used_outside: set  # relax vars used by the block's output or later blocks
    escapes: set = field(default_factory=set)  # ops whose results are read by non-op bindings or later code

    def descendants(self) -> list:
        """Per node, a bitmask of the nodes reachable from it."""
        desc = [0] * len(self.nodes)
        for node in reversed(self.nodes):
            mask = 0
            for consumer in self.consumers[node.index]:
                mask |= (1 << consumer) | desc[consumer]
            desc[node.index] = mask
        return desc

    @functools.cached_property
    def op_readers(self) -> list:
        """Per op, the set of the ops that read one of its results."""
        out = [set() for _ in self.ops]
        for j, op in enumerate(self.ops):
            for ref in op.inputs:
                if ref.op >= 0:
                    out[ref.op].add(j)
        return out

    @property
    def consumers(self) -> list:
        out = [set() for _ in self.nodes]
        for node, prods in enumerate(self.producers):
            for prod in prods:
                out[prod].add(node)
        return out


class _Analyses:
    """Classification and row analysis, computed once per PrimFunc."""

    def __init__(self, mod: tvm.IRModule):
        self.mod = mod
        self.cache = {}

    def of(self, gv: tvm.ir.GlobalVar):
        key = gv.name_hint
        if key not in self.cache:
            func = self.mod[gv]
            cls = classify_primfunc(func)
            rows = analyze_rows(func) if cls.kind.memory_bound else RowInfo((), (), 0, ())
            self.cache[key] = (func, cls, rows)
        return self.cache[key]


def _free_vars(expr) -> list:
    return list(relax.analysis.free_vars(expr))


def _tensor_types(ty) -> list:
    if isinstance(ty, relax.TupleType):
        return list(ty.fields)
    return [ty]


class _Builder:
    def __init__(self, mod: tvm.IRModule, analyses: _Analyses):
        self.mod = mod
        self.analyses = analyses
        self.ops: list = []
        self.externals: list = []
        self.external_index: dict = {}
        self.value_of: dict = {}

    def external(self, expr) -> ValueRef:
        key = expr if isinstance(expr, relax.Var) else id(expr)
        if key not in self.external_index:
            self.external_index[key] = len(self.externals)
            self.externals.append(expr)
        return ValueRef(-1, self.external_index[key])

    def ref(self, expr, local: dict):
        """The ValueRef (or tuple of them) of an argument expression."""
        if isinstance(expr, relax.Var):
            if expr in local:
                return local[expr]
            if expr in self.value_of:
                return self.value_of[expr]
            return self.external(expr)
        if isinstance(expr, relax.TupleGetItem):
            inner = self.ref(expr.tuple_value, local)
            if isinstance(inner, tuple):
                return inner[expr.index]
            return self.external(expr)
        if isinstance(expr, relax.Tuple):
            return tuple(self.ref(f, local) for f in expr.fields)
        return self.external(expr)

    def call_tir_op(self, node: int, call: relax.Call, local: dict):
        """Append the op of a call_tir; returns its result refs, or None if not memory-bound."""
        gv = call.args[0]
        if not isinstance(gv, tvm.ir.GlobalVar) or not isinstance(self.mod[gv], tirx.PrimFunc):
            return None, "call_tir of a non-PrimFunc"
        if len(call.args) > 2:
            return None, "call_tir with shape arguments"
        func, cls, rows = self.analyses.of(gv)
        if not cls.kind.memory_bound:
            return None, f"{gv.name_hint}: {cls.describe()}"
        args = call.args[1]
        arg_list = list(args.fields) if isinstance(args, relax.Tuple) else [args]
        inputs = []
        for arg in arg_list:
            ref = self.ref(arg, local)
            if isinstance(ref, tuple):
                return None, "tuple argument"
            inputs.append(ref)
        out_types = _tensor_types(call.ty_args[0] if call.ty_args else call.ty)
        if not all(isinstance(t, relax.TensorType) for t in out_types):
            return None, "non-tensor output"
        index = len(self.ops)
        self.ops.append(Op(node, gv, func, cls, rows, inputs, out_types))
        refs = tuple(ValueRef(index, k) for k in range(len(out_types)))
        return (refs if len(refs) > 1 else refs[0]), ""


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _node_ops(builder: _Builder, node: int, value):
    """Ops of a binding value; (result refs, reason) with refs None if opaque."""
    if not isinstance(value, relax.Call):
        return None, f"{type(value).__name__} binding"
    if value.op.same_as(_CALL_TIR):
        return builder.call_tir_op(node, value, {})
    if isinstance(value.op, tvm.ir.GlobalVar):
        func = builder.mod[value.op]
        if not isinstance(func, relax.Function) or not (
            func.attrs is not None and func.attrs.get("Primitive")
        ):
            return None, f"call of {value.op.name_hint}"
        start = len(builder.ops)
        local = {p: builder.ref(a, {}) for p, a in zip(func.params, value.args)}
        for block in func.body.blocks:
            for binding in block.bindings:
                inner = binding.value
                if isinstance(inner, relax.Call) and inner.op.same_as(_CALL_TIR):
                    refs, reason = builder.call_tir_op(node, inner, local)
                elif isinstance(inner, (relax.TupleGetItem, relax.Tuple, relax.Var)):
                    refs, reason = builder.ref(inner, local), ""
                else:
                    refs, reason = None, f"{type(inner).__name__} inside {value.op.name_hint}"
                if refs is None:
                    del builder.ops[start:]
                    return None, reason
                local[binding.var] = refs
        return builder.ref(func.body.body, local), ""
    return None, f"call of {value.op}"


def build_graph(mod: tvm.IRModule, block: relax.DataflowBlock, used_outside: set,
                analyses: _Analyses) -> Graph:
    builder = _Builder(mod, analyses)
    nodes: list = []
    owner: dict = {}  # relax var -> node index
    for binding in block.bindings:
        value = binding.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in owner:
            host = nodes[owner[value.tuple_value]]
            if host.stitchable:
                host.aliases.append(binding)
                owner[binding.var] = host.index
                builder.value_of[binding.var] = builder.ref(value, {})
                continue
        index = len(nodes)
        refs, reason = (None, "not a variable binding")
        if isinstance(binding, relax.VarBinding):
            refs, reason = _node_ops(builder, index, value)
        node = Node(index, binding, refs is not None, reason=reason)
        if refs is not None:
            node.ops = [i for i, op in enumerate(builder.ops) if op.node == index]
            builder.value_of[binding.var] = refs
        nodes.append(node)
        owner[binding.var] = index
    producers = []
    escaping_vars = set(used_outside)
    for node in nodes:
        exprs = [node.binding.value] + [a.value for a in node.aliases]
        prods = {owner[v] for e in exprs for v in _free_vars(e) if v in owner}
        prods.discard(node.index)
        producers.append(prods)
        if not node.stitchable:
            escaping_vars.update(v for e in exprs for v in _free_vars(e))
    escapes = set()
    for var in escaping_vars:
        refs = builder.value_of.get(var)
        for ref in refs if isinstance(refs, tuple) else [refs]:
            if isinstance(ref, ValueRef) and ref.op >= 0:
                escapes.add(ref.op)
    return Graph(nodes, builder.ops, builder.externals, producers, builder.value_of, used_outside, escapes)


def analyses_for(mod: tvm.IRModule) -> _Analyses:
    return _Analyses(mod)


def inlined_in_group(graph: Graph, op_ids: set) -> set:
    """Ops a kernel of `op_ids` would inline, so that they do not constrain the group's rows:
    cheap spatial ops whose result stays in the group and whose inputs come from outside
    the group or from other such ops (chains like (x - mean) ** 2)."""
    out = set()
    for i in op_ids:
        op = graph.ops[i]
        if op.cls.kind == OpKind.REDUCTION or op.cls.expensive or len(op.out_types) != 1:
            continue
        if i in graph.escapes:
            continue
        if any(j not in op_ids for j in graph.op_readers[i]):
            continue
        out.add(i)
    changed = True
    while changed:
        changed = False
        for i in list(out):
            if any(ref.op in op_ids and ref.op not in out for ref in graph.ops[i].inputs):
                out.discard(i)
                changed = True
    return out
