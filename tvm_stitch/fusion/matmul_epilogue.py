"""Data-movement ops after a matmul relabelled element-wise, so FuseOps makes them its epilogue.

FuseOps lets a matmul (kOutEWiseFusable) take only consumers reached through
element-wise or broadcast ops; legalized reshapes, transposes and
expand_dims are kInjective, so each ends the matmul's group, and whatever
follows them (head-split transposes, scale + mask, residual adds, the GELU
between the FFN matmuls) becomes a memory-only launch of its own.

This pass runs after AnnotateTIROpPattern and before FuseOps. It follows
every matmul's output forward through element-wise and broadcast ops and
pure copies (a single block storing one load of one input: reshape,
transpose, expand_dims, squeeze, broadcast_to), and gives each such copy
on that path a private PrimFunc labelled element-wise. dlight's Matmul
rule inlines these copies into its output stage. The exception: a reshape
that reads a transpose's output (the head merge back into the hidden
size) keeps its label: inside the matmul's kernel dlight's Matmul rejects it
("consumers of the cache-write stage that are not properly inlined"); left
alone it becomes a view (RewriteDataflowReshape) and launches nothing.

Labels are per PrimFunc and LegalizeOps shares one PrimFunc across call
sites, so the relabelled sites call a copy and the others keep the original.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from tvm_stitch.analysis.classify import is_compute_kernel

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
ELEMWISE, BROADCAST, INJECTIVE, OUT_EWISE_FUSABLE = 0, 1, 2, 4  # TVM's OpPatternKind


def _blocks(func: tirx.PrimFunc) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: found.append(b) if b.name_hint != "root" else None),
                            order="pre")
    return found


def copy_kind(func: tirx.PrimFunc) -> str:
    """"transpose", "reshape" or "broadcast" for a pure copy of one input, "" for anything else.

    A transpose reads its input through a permutation of the output's
    iterators, a broadcast (expand_dims, squeeze, broadcast_to) through a
    subset in order, a reshape through computed indices.
    """
    blocks = _blocks(func)
    if len(blocks) != 1 or len(blocks[0].reads) != 1 or len(blocks[0].writes) != 1:
        return ""
    block = blocks[0]
    body = block.body
    if block.init is not None or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars):
        return ""
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tvm.ir.expr.TensorLoad):
        return ""
    if body.value.source.dtype != body.buffer.dtype:
        return ""
    out = [i for i in body.indices if isinstance(i, tirx.Var)]
    if len(out) != len(body.indices):
        return ""
    positions = []
    for index in body.value.indices:
        if isinstance(index, tirx.IntImm):
            continue
        match = [k for k, var in enumerate(out) if isinstance(index, tirx.Var) and index.same_as(var)]
        if not match:
            return "reshape"
        positions.append(match[0])
    return "broadcast" if positions == sorted(positions) else "transpose"


def _pattern(func) -> int | None:
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "op_pattern" not in func.attrs:
        return None
    return int(func.attrs["op_pattern"])


def _epilogue_sites(mod: tvm.IRModule, func: relax.Function) -> list:
    """The call_tir calls of copies on a matmul's element-wise path, in binding order.

    Each tensor on such a path carries whether a transpose lies between it
    and the matmul (then a reshape of it stays injective).
    """
    after_matmul: dict = {}  # Relax var -> a transpose lies on its path from the matmul
    sites = []
    compute: dict = {}  # GlobalVar -> is_compute_kernel (once per PrimFunc, not per call site)
    for block in func.body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
                continue
            callee = mod[call.args[0]]
            pattern = _pattern(callee)
            if pattern is None:
                continue
            inputs = [a for a in call.args[1].fields if isinstance(a, relax.Var)]
            if pattern == OUT_EWISE_FUSABLE and call.args[0] not in compute:
                compute[call.args[0]] = is_compute_kernel(callee)
            if pattern == OUT_EWISE_FUSABLE and compute[call.args[0]]:
                after_matmul[binding.var] = False
                continue
            reached = [after_matmul[a] for a in inputs if a in after_matmul]
            if not reached:
                continue
            transposed = any(reached)
            if pattern <= BROADCAST:
                after_matmul[binding.var] = transposed
                continue
            kind = copy_kind(callee) if pattern == INJECTIVE else ""
            if not kind or (kind == "reshape" and transposed):
                continue
            sites.append(call)
            after_matmul[binding.var] = transposed or kind == "transpose"
    return sites


@tvm.transform.module_pass(opt_level=0, name="RelabelMatmulEpilogues")
class RelabelMatmulEpilogues:
    """Relabels the copies that follow a matmul element-wise (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        sites = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                for call in _epilogue_sites(mod, func):
                    sites[call] = call.args[0]
        if not sites:
            return mod
        builder = relax.BlockBuilder(mod)
        relabelled = {}
        for callee in sites.values():
            if callee not in relabelled:
                copy = mod[callee].with_attr("op_pattern", ELEMWISE)
                relabelled[callee] = builder.add_func(copy, f"{callee.name_hint}_epilogue")
        rewritten = builder.get()
        rewriter = _Rewriter(rewritten, {call: relabelled[gv] for call, gv in sites.items()})
        for gv, func in list(rewritten.functions_items()):
            if isinstance(func, relax.Function):
                rewritten[gv] = rewriter.visit_expr(func)
        return rewritten


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, callee_of: dict):
        super().__init__(mod)
        self.callee_of = callee_of

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = super().visit_call_(call)
        if call in self.callee_of:
            return relax.Call(new.op, [self.callee_of[call], *new.args[1:]], new.attrs, new.ty_args)
        return new
