"""Transposes that feed only matmuls folded into them: the matmul reads through the transpose.

FuseOps never fuses a producer into a matmul, so a transpose whose only
consumers are matmuls (the activation transposes of weight gradients,
`x^T @ dy`, and the transposes of transposes of backward graphs) is a
memory-only launch of its own. This pass runs after AnnotateTIROpPattern and
before FuseOps: each such matmul call gets a PrimFunc of its own that holds
the transpose's block before the matmul's (TVM's FuseTIR merges the two),
labelled like the matmul; dlight's Matmul rule inlines the transpose into
its global-to-shared load. A transpose used by anything but matmuls stays.
Repeated until nothing folds, so a chain of transposes folds whole.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.fusion.matmul_epilogue import OUT_EWISE_FUSABLE, copy_kind

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _call_tir_bindings(func: relax.Function) -> dict:
    """Var -> its call_tir call, over the function's dataflow blocks."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op.same_as(_CALL_TIR)}


def _is_matmul(mod: tvm.IRModule, call: relax.Call) -> bool:
    func = mod[call.args[0]]
    pattern = func.attrs.get("op_pattern") if isinstance(func, tirx.PrimFunc) and func.attrs is not None else None
    return pattern is not None and int(pattern) == OUT_EWISE_FUSABLE and is_compute_kernel(func)


def _fold_site(mod: tvm.IRModule, func: relax.Function):
    """(matmul var, argument position, transpose call) of one foldable transpose, or None."""
    calls = _call_tir_bindings(func)
    uses: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                uses.setdefault(var, []).append(binding.var)
    for var in relax.analysis.free_vars(func.body.body):
        uses.setdefault(var, []).append(None)
    for var, call in calls.items():
        if not _is_matmul(mod, call):
            continue
        for position, arg in enumerate(call.args[1].fields):
            producer = calls.get(arg)
            if producer is None or copy_kind(mod[producer.args[0]]) != "transpose":
                continue
            if all(user in calls and _is_matmul(mod, calls[user]) for user in uses[arg]):
                return var, position, producer
    return None


def _composed(mod: tvm.IRModule, matmul: relax.Call, position: int, transpose: relax.Call) -> tirx.PrimFunc:
    """One PrimFunc: the transpose's block, then the matmul's reading its result at `position`."""
    mini = tvm.IRModule({gv: mod[gv] for gv in (matmul.args[0], transpose.args[0])})
    builder = relax.BlockBuilder(mini)
    source = transpose.args[1].fields[0]
    args = list(matmul.args[1].fields)
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(args[:position] + [source] + args[position + 1:])]
    with builder.function("group", params, attrs={"Primitive": True}, private=True):
        with builder.dataflow():
            moved = builder.emit(relax.Call(transpose.op, [transpose.args[0], relax.Tuple([params[position]])],
                                            transpose.attrs, transpose.ty_args))
            inner = params[:position] + [moved] + params[position + 1:]
            out = builder.emit_output(relax.Call(matmul.op, [matmul.args[0], relax.Tuple(inner)],
                                                 matmul.attrs, matmul.ty_args))
        group = builder.emit_func_output(out)
    outer = [relax.Var(f"a{i}", p.ty) for i, p in enumerate(params)]
    with builder.function("main", outer):
        with builder.dataflow():
            out = builder.emit_output(relax.Call(group, outer))
        builder.emit_func_output(out)
    fused = relax.transform.FuseTIR()(builder.get())
    (func,) = [f for f in fused.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func.with_attr("op_pattern", OUT_EWISE_FUSABLE)


@tvm.transform.module_pass(opt_level=0, name="FoldTransposesIntoMatmuls")
class FoldTransposesIntoMatmuls:
    """Folds each transpose that feeds only matmuls into them (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        composed: dict = {}  # (matmul PrimFunc, position, transpose PrimFunc) -> GlobalVar
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function):
                continue
            while (site := _fold_site(mod, func)) is not None:
                var, position, transpose = site
                matmul = _call_tir_bindings(func)[var]
                key = (matmul.args[0], position, transpose.args[0])
                if key not in composed:
                    builder = relax.BlockBuilder(mod)
                    name = f"{matmul.args[0].name_hint}_{transpose.args[0].name_hint}_prologue"
                    composed[key] = builder.add_func(_composed(mod, matmul, position, transpose), name)
                    mod = builder.get()
                args = list(matmul.args[1].fields)
                args[position] = transpose.args[1].fields[0]
                new_call = relax.Call(matmul.op, [composed[key], relax.Tuple(args)], matmul.attrs, matmul.ty_args)
                func = _replace_binding(func, var, new_call, matmul.args[1].fields[position])
                mod[gv] = func
        return mod


def _replace_binding(func: relax.Function, var: relax.Var, value: relax.Expr, old_arg: relax.Var) -> relax.Function:
    """`func` with `var` bound to `value`, and without the binding of `old_arg` once nothing uses it."""
    used = set(relax.analysis.free_vars(value)) | set(relax.analysis.free_vars(func.body.body))
    for block in func.body.blocks:
        for binding in block.bindings:
            if not binding.var.same_as(var):
                used.update(relax.analysis.free_vars(binding.value))
    blocks = []
    for block in func.body.blocks:
        bindings = [relax.VarBinding(b.var, value) if b.var.same_as(var) else b for b in block.bindings
                    if not (b.var.same_as(old_arg) and old_arg not in used)]
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)
