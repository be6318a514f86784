"""Outline a group of bindings as a Primitive function and fuse it to one PrimFunc.

The group's bindings (call_tir calls and calls of FuseOps' Primitive
functions, whose bodies are inlined) are re-emitted in a private Relax
function with attribute `Primitive`; TVM's `FuseTIR`, run on a small module
holding just that function and the PrimFuncs it calls, merges it into a
single PrimFunc (its indices over symbolic sizes simplified: see
symbolic_indices.py). The caller gets that PrimFunc, the Relax arguments to pass
to it, and which original variables its outputs define.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, s_tir, sym, tirx

from tvm_stitch.analysis.graph import Graph
from tvm_stitch.analysis.tir_view import block_views, buffer_params, vars_in
from tvm_stitch.kernels.symbolic_indices import simplify_symbolic_indices

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def substitute(expr, vmap: dict):
    """`expr` with variables (and lifted constants) replaced through `vmap` (binding-value forms only)."""
    if isinstance(expr, (relax.Var, tvm.ir.Constant)):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [substitute(a, vmap) for a in expr.args], expr.attrs, expr.ty_args)
    return expr


@dataclass
class Outlined:
    func: tirx.PrimFunc  # the fused PrimFunc, unscheduled
    args: list  # Relax expressions of the original function, one per PrimFunc input (PrimValue: a size)
    outputs: list  # original relax vars, in order: each one PrimFunc output, or a tuple of several
    out_types: list  # TensorType per PrimFunc output
    fields: tuple = ()  # per var of `outputs`: its number of tensor fields if a tuple, else 0 (all 0 if empty)


def _called_globals(mod: tvm.IRModule, expr, found: dict) -> dict:
    """Every global function `expr` calls, transitively, by GlobalVar."""
    if isinstance(expr, relax.Call):
        if isinstance(expr.op, tvm.ir.GlobalVar) and expr.op not in found:
            found[expr.op] = mod[expr.op]
            if isinstance(found[expr.op], relax.Function):
                _called_globals(mod, found[expr.op].body, found)
        for arg in expr.args:
            _called_globals(mod, arg, found)
    elif isinstance(expr, relax.Tuple):
        for field in expr.fields:
            _called_globals(mod, field, found)
    elif isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            for binding in block.bindings:
                _called_globals(mod, binding.value, found)
    elif isinstance(expr, tvm.ir.GlobalVar) and expr not in found:
        found[expr] = mod[expr]
    return found


def _constants_in(mod: tvm.IRModule, expr, found: list) -> list:
    """Tensor constants an expression passes to calls, including inside the Primitive functions it calls.

    FuseTIR rejects tensor constants inside Primitive functions: the outlined
    group takes each as a parameter instead.
    """
    if isinstance(expr, tvm.ir.Constant):
        if not any(expr.same_as(c) for c in found):
            found.append(expr)
    elif isinstance(expr, relax.Call):
        for arg in expr.args:
            _constants_in(mod, arg, found)
        if isinstance(expr.op, tvm.ir.GlobalVar) and isinstance(mod[expr.op], relax.Function):
            for block in mod[expr.op].body.blocks:
                for binding in block.bindings:
                    _constants_in(mod, binding.value, found)
    elif isinstance(expr, relax.Tuple):
        for field in expr.fields:
            _constants_in(mod, field, found)
    return found


def group_outputs(graph: Graph, members: list) -> list:
    """Member variables (tensor-typed) that are used outside the group."""
    member_set = set(members)
    defined = []
    for index in members:
        node = graph.nodes[index]
        defined.append(node.var)
        defined.extend(a.var for a in node.aliases)
    used = set(graph.used_outside)
    for node in graph.nodes:
        if node.index in member_set:
            continue
        exprs = [node.binding.value] + [a.value for a in node.aliases]
        for e in exprs:
            used.update(relax.analysis.free_vars(e))
    return [v for v in defined if v in used]


def outline_group(mod: tvm.IRModule, graph: Graph, members: list, name: str, recomputed: list = ()) -> Outlined:
    """Fuse the member bindings into one PrimFunc (no scheduling).

    `recomputed`: producers the group computes again for its own use (see
    partition.recomputed_in); none of its outputs, they keep their own bindings.
    """
    owned = members
    members = sorted(set(members) | set(recomputed))
    member_vars = set()
    for index in members:
        member_vars.add(graph.nodes[index].var)
        member_vars.update(a.var for a in graph.nodes[index].aliases)
    sizes = _sizes_in(graph, members)
    externals = []
    for index in members:
        node = graph.nodes[index]
        for e in [node.binding.value] + [a.value for a in node.aliases]:
            for v in relax.analysis.free_vars(e):
                # TIR and Relax variables are one class here: the symbolic sizes are left to
                # _undefined_sizes (free_vars lists those passed as call arguments).
                if v not in sizes and v not in member_vars and v not in externals:
                    externals.append(v)
    constants: list = []
    for index in members:
        node = graph.nodes[index]
        for e in [node.binding.value] + [a.value for a in node.aliases]:
            _constants_in(mod, e, constants)
    externals.extend(constants)
    undefined = _undefined_sizes(sizes, externals)
    if undefined:
        externals.append(relax.ShapeExpr(undefined))
    outputs = group_outputs(graph, owned)
    for v in outputs:
        tensors = list(v.ty.fields) if isinstance(v.ty, relax.TupleType) else [v.ty]
        if not tensors or not all(isinstance(t, relax.TensorType) for t in tensors):
            raise ValueError(f"group output {v.name} is not a tensor or a tuple of tensors")
    if not outputs:
        raise ValueError("group has no outputs")

    called: dict = {}
    for index in members:
        _called_globals(mod, graph.nodes[index].binding.value, called)
    mini_mod = tvm.IRModule({gv: f for gv, f in called.items() if isinstance(f, tirx.PrimFunc)})

    outlined_mod, main_params = _outlined_module(mod, mini_mod, graph, members, name, externals, outputs,
                                                 [v.ty for v in externals])
    forms = _member_forms(outlined_mod[name], mini_mod)
    if forms:
        # FuseTIR matches a parameter's shape to the member PrimFunc's literally (s * 2 is not 2 * s).
        outlined_mod, main_params = _outlined_module(mod, mini_mod, graph, members, name, externals, outputs,
                                                     [forms.get(i, v.ty) for i, v in enumerate(externals)])
    # An ill-formed group (a symbolic variable left undefined) sends FuseTIR into endless recursion.
    _check_well_formed(tvm.IRModule({gv: f for gv, f in outlined_mod.functions_items() if gv.name_hint != "main"}),
                       "outlined group")
    fused_mod = relax.transform.FuseTIR()(outlined_mod)
    _check_well_formed(fused_mod, "FuseTIR's result")
    call = _single_call_tir(fused_mod["main"])
    fused_gv = call.args[0]
    arg_exprs = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
    by_param = dict(zip(main_params, externals))
    # Symbolic sizes the PrimFunc takes as scalars come as PrimValues of the caller's variables.
    args = [by_param.get(a, a) for a in arg_exprs]
    fields = tuple(len(v.ty.fields) if isinstance(v.ty, relax.TupleType) else 0 for v in outputs)
    out_types = [t for v in outputs for t in (v.ty.fields if isinstance(v.ty, relax.TupleType) else [v.ty])]
    func = simplify_symbolic_indices(without_dead_blocks(fused_mod[fused_gv]))
    return Outlined(func, args, outputs, out_types, fields)


def without_dead_blocks(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` without the element-wise blocks whose results reach no output.

    A member op with several results of which the group returns some (TVM's
    batch_norm: the normalised tensor, and the moving mean and variance the
    caller dropped) leaves blocks that write buffers nothing reads; kept, they
    would be global allocations, which CUDA lowering rejects. Dead reductions
    stay (s_tir inlines only element-wise blocks).
    """
    sch = s_tir.Schedule(func)
    views = block_views(sch)
    params = buffer_params(func)
    live = set()
    for view in reversed(views):
        writes_output = any(w.buffer.same_as(p) for w in view.writes for p in params)
        read_live = any(r.buffer.same_as(w.buffer) for other in views if other.name in live
                        for r in other.reads for w in view.writes)
        if writes_output or read_live:
            live.add(view.name)
    dead = [v for v in reversed(views) if v.name not in live and not v.has_reduction]
    if not dead:
        return func
    for view in dead:
        sch.compute_inline(sch.get_sblock(view.name))
    return sch.mod["main"]


def _outlined_module(mod, mini_mod, graph, members, name, externals, outputs, types) -> tuple:
    """(module of the Primitive group function `name` and a `main` calling it, main's parameters).

    The group function's parameters take `types`, one per external; main's, the externals' own.
    """
    bb = relax.BlockBuilder(mini_mod)
    params = [relax.Var(_name(v, i), ty) for i, (v, ty) in enumerate(zip(externals, types))]
    vmap = dict(zip(externals, params))
    with bb.function(name, params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            for index in members:
                node = graph.nodes[index]
                vmap[node.var] = _emit_value(bb, mod, node.binding.value, vmap)
                for alias in node.aliases:
                    vmap[alias.var] = bb.emit(substitute(alias.value, vmap))
            results = []
            for v in outputs:  # a tuple result (TVM's batch_norm) returns its fields
                results += ([bb.emit(relax.TupleGetItem(vmap[v], i)) for i in range(len(v.ty.fields))]
                            if isinstance(v.ty, relax.TupleType) else [vmap[v]])
            ret = bb.emit_output(relax.Tuple(results) if len(results) > 1 else results[0])
        group_gv = bb.emit_func_output(ret)

    main_params = [relax.Var(_name(v, i), v.ty) for i, v in enumerate(externals)]
    with bb.function("main", main_params):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(group_gv, main_params))
        bb.emit_func_output(out)
    return bb.get(), main_params


_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max)


def _in_caller_terms(expr, binding: dict):
    """`expr` (a PrimFunc's shape dimension) with its variables replaced through `binding`; None when
    it holds a variable `binding` lacks or a form other than integer arithmetic."""
    if isinstance(expr, tirx.IntImm):
        return expr
    if isinstance(expr, tirx.Var):
        return binding.get(expr)
    if isinstance(expr, _ARITHMETIC):
        a, b = _in_caller_terms(expr.a, binding), _in_caller_terms(expr.b, binding)
        return None if a is None or b is None else type(expr)(a, b)
    return None


def _member_forms(group: relax.Function, mini_mod: tvm.IRModule) -> dict:
    """{parameter index: its type in the form the first member PrimFunc reading it declares} for the
    parameters of `group` whose shape forms differ from it but are provably equal (`s * 2`, `2 * s`)."""
    forms: dict = {}
    index = {p: i for i, p in enumerate(group.params)}
    analyzer = sym.Analyzer()
    for block in group.body.blocks:
        for b in block.bindings:
            call = b.value
            if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
                continue
            args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
            outs = list(b.var.ty.fields) if isinstance(b.var.ty, relax.TupleType) else [b.var.ty]
            # (argument or None for an output, its type, the PrimFunc's shape at its place)
            pairs = [(a, ty, p.ty.shape) for a, ty, p in zip(args + [None] * len(outs), [a.ty for a in args] + outs,
                                                             buffer_params(mini_mod[call.args[0]]))
                     if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)
                     and len(ty.shape.values) == len(p.ty.shape)]
            binding = {d: e for _, ty, shape in pairs for d, e in zip(shape, ty.shape.values) if isinstance(d, tirx.Var)}
            for a, ty, shape in pairs:
                if a not in index or index[a] in forms:
                    continue
                dims = [_in_caller_terms(d, binding) for d in shape]
                values = ty.shape.values
                if all(d is not None and analyzer.can_prove_equal(d, v) for d, v in zip(dims, values)) \
                        and not all(tvm_ffi.structural_equal(d, v) for d, v in zip(dims, values)):
                    forms[index[a]] = relax.TensorType(dims, ty.dtype)
    return forms


def _sizes_in(graph: Graph, members: list) -> list:
    """The symbolic size variables of the members' values and types (those inside shapes), in order."""
    found: list = []

    def on_shape(shape):
        for var in vars_in(shape):
            if var not in found:
                found.append(var)

    for index in members:
        node = graph.nodes[index]
        for binding in [node.binding] + list(node.aliases):
            tvm_ffi.structural_walk(binding.value, (relax.ShapeExpr, on_shape), order="post")
            tvm_ffi.structural_walk(binding.var.ty, (relax.ShapeExpr, on_shape), order="post")
    return found


def _undefined_sizes(sizes: list, externals: list) -> list:
    """The sizes no external's shape defines (an `arange(s)` fed only by a Shape argument): the
    outlined group takes them as a Shape parameter."""
    defined = set()
    for ext in externals:
        ty = ext.ty
        dims = ty.shape.values if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr) else (
            ty.values if isinstance(ty, relax.ShapeType) and ty.values is not None else [])
        defined.update(d for d in dims if isinstance(d, tirx.Var))
    return [v for v in sizes if v not in defined]


def _check_well_formed(mod: tvm.IRModule, what: str) -> None:
    """Raise ValueError naming `what` when `mod` is not well-formed (TVM's checker raises or logs)."""
    try:
        relax.analysis.well_formed(mod)
    except Exception as err:  # noqa: BLE001 - any complaint of the checker means: not fused
        raise ValueError(f"{what} is not well-formed: {str(err).strip().splitlines()[-1][:160]}") from err


def _name(value, index: int) -> str:
    if isinstance(value, relax.ShapeExpr):
        return "sizes"
    return value.name if isinstance(value, relax.Var) else f"const{index}"


def _emit_value(bb: relax.BlockBuilder, mod: tvm.IRModule, value, vmap: dict):
    """Emit a binding value; Primitive function calls are inlined binding by binding."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
        func = mod[value.op]
        if isinstance(func, relax.Function):
            args = [substitute(a, vmap) for a in value.args]
            func = _bound_to_caller(func, args)
            local = dict(vmap)
            for p, a in zip(func.params, args):
                local[p] = a
            for block in func.body.blocks:
                for binding in block.bindings:
                    local[binding.var] = bb.emit(substitute(binding.value, local))
            body = substitute(func.body.body, local)
            return body if isinstance(body, relax.Var) else bb.emit(body)
    return bb.emit(substitute(value, vmap))


def _bound_to_caller(func: relax.Function, args: list) -> relax.Function:
    """`func` with its symbolic variables replaced by the caller's expressions for them.

    Each Primitive function of FuseOps defines its own symbolic variables
    (through its parameters' shapes and Shape parameters); inlined as they
    are, those would be undefined in the outlined group. Each plain variable
    is paired with the expression the caller passes at its place; a variable
    met twice must get the same expression both times.
    """
    binding: dict = {}
    analyzer = sym.Analyzer()

    def pair(dims, values, where):
        for dim, value in zip(dims, values):
            if not isinstance(dim, tirx.Var):
                continue
            if dim in binding and not analyzer.can_prove_equal(binding[dim], value):
                raise ValueError(f"symbolic {dim.name} of {where} is bound to both {binding[dim]} and {value}")
            binding.setdefault(dim, value)

    for param, arg in zip(func.params, args):
        pty, aty = param.ty, arg.ty
        if isinstance(pty, relax.TensorType) and isinstance(aty, relax.TensorType):
            if pty.shape is not None and aty.shape is not None and isinstance(pty.shape, relax.ShapeExpr) \
                    and isinstance(aty.shape, relax.ShapeExpr):
                pair(pty.shape.values, aty.shape.values, param.name)
        elif isinstance(pty, relax.ShapeType) and isinstance(aty, relax.ShapeType):
            if pty.values is not None and aty.values is not None:
                pair(pty.values, aty.values, param.name)
        elif isinstance(arg, relax.ShapeExpr) and isinstance(pty, relax.ShapeType) and pty.values is not None:
            pair(pty.values, arg.values, param.name)
    return func.bind_symbolic_vars(binding) if binding else func


def _single_call_tir(main: relax.Function) -> relax.Call:
    calls = [
        b.value
        for block in main.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and b.value.op.same_as(_CALL_TIR)
    ]
    if len(calls) != 1:
        raise ValueError(f"FuseTIR produced {len(calls)} calls instead of one")
    return calls[0]
