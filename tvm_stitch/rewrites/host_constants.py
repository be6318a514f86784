"""Constant subgraphs evaluated on the host at compile time (GPU targets).

A static export of a transformers decoder computes its packed-sequence
check and causal mask from `arange`s of constant sizes: `arange`, slices,
a `concat`, a `not_equal`, a `cumsum` over a bool tensor, comparisons and a
`where`, none of which reads an input of the model. TVM's FoldConstant
runs after LegalizeOps and evaluates a PrimFunc by building it for the CPU,
so on a GPU target it stops at the first op legalized with thread bindings
(the `cumsum`'s scan: four launches per call, plus the mask's kernels).
This pass, before LegalizeOps, takes the Relax bindings that depend on no
parameter of their function, builds them as one Relax function for the
host CPU (TVM's own llvm legalization), runs it once, and replaces each
such binding that the rest of the function reads by its value as a
constant. What is folded:
- a call of a Relax operator (not `call_tir`, `call_packed` or other calls
  of functions, not a random or printing op) whose arguments are
  constants, static shapes and scalars, or bindings folded themselves;
- whose result is a tensor (or a tuple of tensors) of static shape of at
  most `max_bytes` each (a larger constant would cost more memory than the
  kernel it saves costs time).
A symbolic size makes its `arange` depend on the call, so nothing of a
symbolic shape folds.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.tir_view import static_product
from tvm_stitch.target import default_pipeline

MAX_BYTES = 1 << 22  # the largest constant a fold may create (4 MiB)
_NOT_FOLDED = ("relax.call", "relax.print", "relax.assert", "relax.random", "relax.null_value")


def static_tensor_bytes(ty) -> int | None:
    """Bytes of a tensor type of static shape, else None."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    elements = static_product(ty.shape.values)
    return None if elements is None else elements * max(1, tvm.DataType(str(ty.dtype)).bits // 8)


def _fits(ty, max_bytes: int) -> bool:
    fields = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    sizes = [static_tensor_bytes(f) for f in fields]
    return bool(fields) and all(s is not None and s <= max_bytes for s in sizes)


def _constant_arg(arg, folded: set) -> bool:
    if isinstance(arg, relax.Var):
        return arg in folded
    if isinstance(arg, relax.Tuple):
        return all(_constant_arg(f, folded) for f in arg.fields)
    if isinstance(arg, relax.ShapeExpr):
        return all(isinstance(d, tirx.IntImm) for d in arg.values)
    # TVM 0.27's Relax scalars are TIR immediates, its constants `tvm.ir.Constant`.
    return isinstance(arg, (tirx.IntImm, tirx.FloatImm, tvm.ir.Constant, tvm.ir.StringImm))


def _foldable(value, folded: set, max_bytes: int) -> bool:
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    if value.op.name.startswith(_NOT_FOLDED) or not value.op.name.startswith("relax."):
        return False
    return _fits(value.ty, max_bytes) and all(_constant_arg(a, folded) for a in value.args)


def read_outside(func: relax.Function, inside: set) -> set:
    """The vars of `inside` that a binding outside it, or the function's result, reads."""
    read = set(relax.analysis.free_vars(func.body.body))
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var not in inside:
                read |= set(relax.analysis.free_vars(binding.value))
    return read & inside


def constant_bindings(func: relax.Function, max_bytes: int = MAX_BYTES) -> tuple:
    """(bindings that depend on no parameter, in order; the vars among them read elsewhere)."""
    folded, bindings = set(), []
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding) and _foldable(binding.value, folded, max_bytes):
                folded.add(binding.var)
                bindings.append(binding)
    read = read_outside(func, folded)
    return bindings, [b.var for b in bindings if b.var in read]


def evaluate_bindings(bindings: list, outputs: list, params: list = (), args: tuple = ()) -> list:
    """numpy values of `outputs`, computed by `bindings` (reading only `params`, given `args`) in a
    function built with TVM's default pipeline for the host CPU and run there."""
    result = relax.Var("values", relax.TupleType([v.ty for v in outputs]))
    body = relax.SeqExpr([relax.DataflowBlock(list(bindings) + [relax.VarBinding(result, relax.Tuple(outputs))])],
                         result)
    main = relax.Function(list(params), body, result.ty).with_attr("global_symbol", "main")
    host = tvm.target.Target("llvm")
    executable = tvm.compile(tvm.IRModule({"main": main}), target=host, relax_pipeline=default_pipeline(host))
    values = relax.VirtualMachine(executable, tvm.cpu())["main"](*args)
    return [values[i].numpy() for i in range(len(outputs))]


def with_values(func: relax.Function, values: dict) -> relax.Function:
    """`func` with the bindings of the vars in `values` (var -> Relax expression) bound to those
    expressions instead, and the bindings nothing reads any more dropped."""
    blocks = []
    for block in func.body.blocks:
        bindings = [relax.VarBinding(b.var, values[b.var]) if b.var in values else b for b in block.bindings]
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    new = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                         func.attrs)
    return relax.analysis.remove_all_unused(new)


@tvm.transform.module_pass(opt_level=0, name="FoldHostConstants")
class FoldHostConstants:
    """Evaluates the constant subgraphs of every Relax function on the host (module docstring)."""

    def __init__(self, max_bytes: int = MAX_BYTES, report=None):
        self.max_bytes = max_bytes
        self.report = report  # a StitchReport: how many bindings each function folded

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            bindings, outputs = constant_bindings(func, self.max_bytes)
            # A tensor result alone: a tuple-valued constant has no Relax constant form here.
            outputs = [v for v in outputs if isinstance(v.ty, relax.TensorType)]
            if not outputs or all(isinstance(b.value, tvm.ir.Constant) for b in bindings):
                continue
            values = {v: relax.const(value, str(v.ty.dtype))
                      for v, value in zip(outputs, evaluate_bindings(bindings, outputs))}
            updates[gv] = with_values(func, values)
            if self.report is not None:
                self.report.notes.append(f"{gv.name_hint}: {len(bindings)} bindings of constants evaluated on the "
                                         f"host, {len(outputs)} kept as constants")
        if not updates:
            return mod
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in updates.items():
            out[gv] = func
        return out
