"""A matmul and the producers folded into it, composed as one PrimFunc (FuseTIR over a group of their calls),
and the key under which two sites compose alike (the layers of a model share one composition)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from tvm_stitch.analysis.op_patterns import OUT_EWISE_FUSABLE

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def call_tir_bindings(func: relax.Function) -> dict:
    """Var -> its call_tir call, over the function's dataflow blocks."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op.same_as(_CALL_TIR)}


def composition_wiring(matmul: relax.Call, chain: list):
    """(key, leaves) of folding `chain` ([(var, producer call)] in binding order) into `matmul`:
    `leaves` are the inputs from outside the chain, each once, in order of first use; `key` is the
    same for two sites exactly when their compositions are (the same PrimFuncs, wired alike, on
    arguments of the same types)."""
    position = {var: j for j, (var, _) in enumerate(chain)}
    leaves, leaf_index = [], {}

    def ref(arg):
        if arg in position:
            return ("chain", position[arg])
        if arg not in leaf_index:
            leaf_index[arg] = len(leaves)
            leaves.append(arg)
        return ("leaf", leaf_index[arg])

    def call_key(call):
        return (call.args[0], tuple(ref(a) for a in call.args[1].fields),
                tuple(tvm_ffi.structural_hash(t) for t in call.ty_args))

    key = (tuple(call_key(producer) for _, producer in chain), call_key(matmul))
    return key + (tuple(tvm_ffi.structural_hash(leaf.ty) for leaf in leaves),), leaves


def compose_calls(mod: tvm.IRModule, matmul: relax.Call, chain: list, leaves: list):
    """(PrimFunc, order): the blocks of the chain's producers, in order, then the matmul's reading
    their results; its parameters are `leaves[i]` for i in `order` (FuseTIR merges repeated
    arguments)."""
    mini = tvm.IRModule({gv: mod[gv] for gv in {matmul.args[0], *(p.args[0] for _, p in chain)}})
    builder = relax.BlockBuilder(mini)
    params = [relax.Var(f"p{i}", leaf.ty) for i, leaf in enumerate(leaves)]
    inner = dict(zip(leaves, params))

    def call(c: relax.Call) -> relax.Call:
        return relax.Call(c.op, [c.args[0], relax.Tuple([inner[a] for a in c.args[1].fields])], c.attrs, c.ty_args)

    with builder.function("group", params, attrs={"Primitive": True}, private=True):
        with builder.dataflow():
            for var, producer in chain:
                inner[var] = builder.emit(call(producer))
            out = builder.emit_output(call(matmul))
        group = builder.emit_func_output(out)
    main_params = [relax.Var(f"a{i}", p.ty) for i, p in enumerate(params)]
    with builder.function("main", main_params):
        with builder.dataflow():
            out = builder.emit_output(relax.Call(group, main_params))
        builder.emit_func_output(out)
    fused = relax.transform.FuseTIR()(builder.get())
    (fused_call,) = call_tir_bindings(fused["main"]).values()
    index = {p: i for i, p in enumerate(main_params)}
    func = fused[fused_call.args[0]].with_attr("op_pattern", OUT_EWISE_FUSABLE)
    return func, [index[a] for a in fused_call.args[1].fields]
