"""An optimizer's `_foreach_*` ops as one op per tensor, which TVM's importer converts and the stitch pass groups.

`torch.optim.AdamW(..., foreach=True)` under `torch.compile` traces to
`_foreach_mul`, `_foreach_addcdiv`, `_foreach_sqrt`, ... over lists of
tensors; the importer has no converter for them. Each becomes the
per-tensor ATen op over the i-th element of every tensor (or scalar)
list, the other arguments as they are: `.List` and `.Tensor` forms map to
`.Tensor`, `.Scalar` and `.ScalarList` to `.Scalar` (`.Tensor` where the
op has no `.Scalar` form), `.ScalarAndTensor` (a scalar base) to
`.Scalar`, `.default` to `.default`. addcmul, addcdiv and lerp, which the
importer lacks too, get converters here.
"""

from __future__ import annotations

import operator

from tvm import relax

PREFIX = "_foreach_"
OVERLOADS = {"List": ("Tensor",), "Tensor": ("Tensor",), "Scalar": ("Scalar", "Tensor"),
             "ScalarList": ("Scalar", "Tensor"), "ScalarAndTensor": ("Scalar",), "default": ("default",)}
SCALAR_FORMS = {"addcmul", "addcdiv"}  # a foreach `.Scalar` form that is the op's `.default` with `value=`


def foreach_as_loops(gm) -> bool:
    """Rewrite `gm`'s foreach ops in place (an overload with no per-tensor form stays); whether any was rewritten."""
    changed = False
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", "")
        if node.op != "call_function" or not name.startswith(PREFIX):
            continue
        op = _per_tensor(name)
        if op is None:
            continue
        length = next(len(a) for a in node.args if isinstance(a, (list, tuple)))
        with gm.graph.inserting_before(node):
            items = [gm.graph.call_function(op, tuple(_at(a, i) for a in node.args),
                                            {k: _at(v, i) for k, v in node.kwargs.items()}) for i in range(length)]
        for i, item in enumerate(items):
            item.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
            if isinstance(node.meta.get("val"), (list, tuple)):
                item.meta["val"] = node.meta["val"][i]
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(items[user.args[1]])
                gm.graph.erase_node(user)
        if not node.users:
            gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return changed


def _per_tensor(name: str):
    import torch

    op, _, overload = name[len(PREFIX):].partition(".")
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return None
    if op in SCALAR_FORMS and overload == "Scalar":
        return packet.default
    return next((getattr(packet, o) for o in OVERLOADS.get(overload, ()) if hasattr(packet, o)), None)


def _at(arg, i):
    return arg[i] if isinstance(arg, (list, tuple)) else arg


def converters() -> dict:
    return {"addcmul.default": _addc(relax.op.multiply), "addcdiv.default": _addc(relax.op.divide),
            "lerp.Scalar": _lerp, "lerp.Tensor": _lerp}


def _addc(combine):
    def convert(node, importer):
        x, t1, t2 = (importer.env[a] for a in node.args[:3])
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)
        product = combine(t1, t2)
        if value != 1:
            product = relax.op.multiply(product, relax.const(value, x.ty.dtype))
        return importer.block_builder.emit(relax.op.add(x, product))

    return convert


def _lerp(node, importer):
    start, end = importer.env[node.args[0]], importer.env[node.args[1]]
    weight = node.args[2]
    weight = importer.env[weight] if hasattr(weight, "op") else relax.const(weight, start.ty.dtype)
    return importer.block_builder.emit(relax.op.add(start, relax.op.multiply(weight, relax.op.subtract(end, start))))
