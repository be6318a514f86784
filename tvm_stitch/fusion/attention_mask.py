"""The kind of an attention mask computed from a symbolic length alone, decided at every length its bounds allow.

Under a symbolic sequence length a decoder's causal mask is not a constant:
transformers builds it from `arange(s)` (and the position ids) in the
graph. Where the mask's bindings read constants and one symbolic size `s`
alone (fusion/attention.constant_slice), and `s` has an upper bound (the
function's `tir_var_upper_bound`; Relax plans memory for it, no call
exceeds it), the mask is evaluated on the host at every `s` from its lower
bound to its upper bound (one build, one run per value; MAX_ELEMENTS mask
elements in all at most): zeros at every size make no mask, causal
(analysis/attention_chain.is_causal) at every size a causal mask the
kernel computes from the indices. Otherwise, or where anything else is
the case, the mask stays one the kernel reads.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.attention_chain import is_causal
from tvm_stitch.analysis.shape_dims import at_values, dims, product, sizes_in
from tvm_stitch.target import default_pipeline

MAX_ELEMENTS = 1 << 24  # mask elements evaluated over all sizes together (64 MiB of float32)


def symbolic_mask_kind(bindings: list | None, mask: relax.Var, q_len, kv_len, bounds: dict) -> str:
    """"none", "causal" or "additive" for `mask` (of symbolic shape, computed by `bindings` from constants
    and sizes alone; None where it is not) over scores of q_len x kv_len; `bounds`: the function's {size
    name: (lower, upper or None)}."""
    names = sizes_in([dims(mask), (q_len, kv_len)])
    if (bindings is None or len(names) != 1 or bounds.get(names[0], (0, None))[1] is None
            or not {v.name for v in sizes_read(bindings)} <= set(names)):
        return "additive"
    low, high = bounds[names[0]]
    values = range(max(low, 1), high + 1)
    if sum(at_values(product(dims(mask)), {names[0]: v}) for v in values) > MAX_ELEMENTS:
        return "additive"
    try:
        run = _mask_function(bindings, mask, _size_var([*mask.ty.shape.values, q_len, kv_len], names[0]))
    except tvm.error.TVMError:  # a mask the host cannot build alone: the kernel reads it
        return "additive"
    kinds = set()
    for value in values:
        data = run(value)
        at = {names[0]: value}
        q, kv = at_values(q_len, at), at_values(kv_len, at)
        kinds.add("none" if not data.any() else "causal" if is_causal(data, q, kv) else "additive")
        if "additive" in kinds or len(kinds) > 1:
            return "additive"
    return kinds.pop()


def _mask_function(bindings: list, mask: relax.Var, var):
    """value -> the mask (numpy) at size `var` = value: the bindings built once, for the host, as a
    function of a shape parameter that defines the size."""
    sizes, result = relax.Var("sizes", relax.ShapeType([var])), relax.Var("mask", mask.ty)
    body = relax.SeqExpr([relax.DataflowBlock(list(bindings) + [relax.VarBinding(result, mask)])], result)
    main = relax.Function([sizes], body, mask.ty).with_attr("global_symbol", "main")
    host = tvm.target.Target("llvm")
    executable = tvm.compile(tvm.IRModule({"main": main}), target=host, relax_pipeline=default_pipeline(host))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return lambda value: np.asarray(vm["main"](tvm.runtime.ShapeTuple([value])).numpy(), dtype=np.float64)


def sizes_read(bindings: list) -> list:
    """The symbolic sizes the bindings' values read (in shapes, in arguments such as arange's end)."""
    return list({v: None for b in bindings for v in relax.analysis.free_symbolic_vars(b.value)})


def _size_var(exprs: list, name: str):
    return next(v for e in exprs if not isinstance(e, int) for v in tirx.analysis.undefined_vars(e, []) if v.name == name)
