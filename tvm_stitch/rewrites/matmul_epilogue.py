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

On CUDA each copy is priced before it is relabelled
(rewrites/epilogue_price.py): one dlight would schedule more slowly with the
compute kernel than the two apart keeps its label, and ends the path.

Labels are per PrimFunc and LegalizeOps shares one PrimFunc across call
sites, so the relabelled sites call a copy and the others keep the original.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.analysis.op_patterns import BROADCAST, ELEMWISE, INJECTIVE, OPAQUE, OUT_EWISE_FUSABLE
from tvm_stitch.kernels.symbolic_indices import simplify_symbolic_indices
from tvm_stitch.planning.limits import PartitionLimits

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


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


def _tiny_constant(value) -> bool:
    """A constant small enough that the stitch pass recomputes what reads it (the partition's limit)."""
    ty = value.ty
    return (isinstance(value, tvm.ir.Constant) and isinstance(ty, relax.TensorType)
            and isinstance(ty.shape, relax.ShapeExpr)
            and all(isinstance(d, tirx.IntImm) for d in ty.shape.values)
            and int(np.prod([int(d) for d in ty.shape.values])) <= PartitionLimits.recompute_input_elements)


def _symbolic_index_only(mod: tvm.IRModule, func: relax.Function) -> set:
    """Relax vars computed from sizes alone (an `arange` of a symbolic length and the spatial ops
    after it, reading no tensor but tiny constants), of symbolic shape: FoldConstant cannot fold
    them, and the stitch pass recomputes them where a stitched group reads them."""
    constants = set()
    index_only = set()
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if _tiny_constant(value):
                constants.add(binding.var)
                continue
            if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
                continue
            pattern = _pattern(mod[value.args[0]])
            if pattern is None or pattern > INJECTIVE:
                continue
            args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
            if all(a in index_only or a in constants or _tiny_constant(a) for a in args):
                index_only.add(binding.var)
    return {v for v in index_only if any(not isinstance(d, tirx.IntImm) for d in _shape(v))}


def _shape(var) -> list:
    ty = var.ty
    return list(ty.shape.values) if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr) else []


def _epilogue_sites(mod: tvm.IRModule, func: relax.Function, pricer=None) -> list:
    """The call_tir calls of copies on a matmul's element-wise path, in binding order.

    Each tensor on such a path carries whether a transpose lies between it
    and the matmul (then a reshape of it stays injective), the copies on its
    path and the path's bindings from the matmul on. A path reaching an op
    that reads a symbolic index-only tensor (a mask of a symbolic length)
    keeps its copies: relabelled, they would pull that op into the matmul's
    kernel, which reads the mask from memory, where the stitched group after
    the copy computes it for free. A copy `pricer` (rewrites/epilogue_price.py)
    finds slower in the kernel stays a kernel, and ends the path.
    """
    index_only = _symbolic_index_only(mod, func)
    after_matmul: dict = {}  # Relax var -> (a transpose lies on its path, copies on it, path bindings)
    sites, kept = [], set()
    compute: dict = {}  # GlobalVar -> is_compute_kernel (once per PrimFunc, not per call site)
    for binding in (b for block in func.body.blocks for b in block.bindings):
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
            after_matmul[binding.var] = (False, (), ((binding.var, call),))
            continue
        reached = [after_matmul[a] for a in inputs if a in after_matmul]
        if not reached:
            continue
        transposed = any(t for t, _, _ in reached)
        copies = tuple(c for _, path, _ in reached for c in path)
        path = reached[0][2] + ((binding.var, call),)
        if pattern <= BROADCAST:
            if any(a in index_only for a in inputs):
                kept.update(copies)
                continue
            after_matmul[binding.var] = (transposed, copies, path)
            continue
        kind = copy_kind(callee) if pattern in (INJECTIVE, OPAQUE) else ""
        if not kind or (kind == "reshape" and transposed):
            continue
        if pricer is not None and not pricer.pays(mod, list(reached[0][2]), call, binding.var):
            continue
        sites.append(call)
        after_matmul[binding.var] = (transposed or kind == "transpose", copies + (call,), path)
    return [call for call in sites if call not in kept]


@tvm.transform.module_pass(opt_level=0, name="RelabelMatmulEpilogues")
class RelabelMatmulEpilogues:
    """Relabels the copies that follow a matmul element-wise (see the module docstring); with a
    `pricer` (rewrites/epilogue_price.py's EpiloguePricer), only those it finds pay."""

    def __init__(self, pricer=None):
        self.pricer = pricer

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        sites = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                for call in _epilogue_sites(mod, func, self.pricer):
                    sites[call] = call.args[0]
        if not sites:
            return mod
        builder = relax.BlockBuilder(mod)
        relabelled = {}
        for callee in sites.values():
            if callee not in relabelled:
                copy = simplify_symbolic_indices(mod[callee]).with_attr("op_pattern", ELEMWISE)
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
