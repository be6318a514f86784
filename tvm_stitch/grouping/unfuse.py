"""A dataflow block with FuseOps' groups opened: one binding per operator, for the fusion search.

FuseOps' groups are cut by its patterns, not by cost: the search (fusion_search.py)
places single operators, so a cut may fall inside one (a mean's reduction in one
kernel, the subtract that reads it with a column reduction in another). Each
call of a Primitive function whose result is one of its bindings becomes that
function's bindings, in order, its parameters replaced by the arguments and its
symbolic variables by the caller's (outline._bound_to_caller); the binding of
the result keeps the original variable, so later code reads it unchanged. A
function returning a tuple expression stays one binding.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_stitch.kernels.outline import _bound_to_caller, substitute


def _opened(mod: tvm.IRModule, binding) -> list | None:
    """The bindings replacing `binding`, or None where it stays as it is."""
    value = binding.value
    if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.GlobalVar)):
        return None
    func = mod[value.op]
    if not (isinstance(func, relax.Function) and func.attrs is not None and func.attrs.get("Primitive")):
        return None
    try:
        func = _bound_to_caller(func, list(value.args))
    except ValueError:  # a symbolic variable bound two ways: left as one binding
        return None
    inner = [b for block in func.body.blocks for b in block.bindings]
    result = func.body.body
    if len(inner) < 2 or not any(result.same_as(b.var) for b in inner):
        return None
    if not all(isinstance(b, relax.VarBinding) for b in inner):
        return None
    local = dict(zip(func.params, value.args))
    out = []
    for b in inner:
        var = binding.var if result.same_as(b.var) else relax.DataflowVar(b.var.name, b.var.ty)
        out.append(relax.VarBinding(var, substitute(b.value, local)))
        local[b.var] = var
    if not out[-1].var.same_as(binding.var):
        return None  # the result is not the last binding: later ones would follow the original variable
    return out


def opened_block(mod: tvm.IRModule, block: relax.DataflowBlock, which: set) -> tuple:
    """(block, origin): the block with the FuseOps groups bound to the variables `which` opened (the
    memory-intensive ones: a matmul's group keeps its epilogue); origin maps each binding variable of
    the new block to the variable of the binding it came from."""
    bindings, origin = [], {}
    for binding in block.bindings:
        opened = _opened(mod, binding) if binding.var in which else None
        for b in opened or [binding]:
            bindings.append(b)
            origin[b.var] = binding.var
    return relax.DataflowBlock(bindings), origin
