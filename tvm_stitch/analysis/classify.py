"""What each call_tir computes, derived from its PrimFunc's blocks (not op names).

Kinds, from cheapest to excluded:
- elementwise: every read indexes its buffer exactly as the write does;
- broadcast: reads use a subset of the output's iterators, in order;
- injective: any other spatial map (transpose, reshape, slice, gather);
- reduction: a block with reduce iterators; the axes reduced on its input
  say whether it is a row (innermost), column (outermost), middle or full one;
- compute-intensive: a reduction that reads two tensors through the reduce
  axes with reuse between them (matmul, conv, attention scores), unless one
  of them has fewer than MMA_NARROW_SIDE rows (or columns) per batch: a
  small GEMM (attention pooling, a per-row weighted sum) is a reduction over
  k of an element-wise product and stitches with its neighbours;
- unsupported: anything the views cannot describe (regions accessed other
  than element by element, non-trivial loop nests, no blocks).

Reads through computed indices (gathers) are element accesses like any other:
a block with one is injective unless it reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import tvm_ffi
from tvm import tirx

from tvm_stitch.analysis.tir_view import REGION, BlockView, all_block_views, function_views, static_product, vars_in


# A contraction whose one operand has fewer rows (or columns) per batch than the narrow side of the
# smallest tensor-core tile (m16n8k8) pads every MMA it would issue and reuses each element of the
# other operand fewer times than that: a tiled GEMM has nothing to win, and the op streams its large
# operand once like a reduction over k of an element-wise product.
MMA_NARROW_SIDE = 8


class OpKind(str, Enum):
    ELEMENTWISE = "elementwise"
    BROADCAST = "broadcast"
    INJECTIVE = "injective"
    REDUCTION = "reduction"
    COMPUTE = "compute-intensive"
    UNSUPPORTED = "unsupported"

    @property
    def memory_bound(self) -> bool:
        return self not in (OpKind.COMPUTE, OpKind.UNSUPPORTED)


@dataclass(frozen=True)
class OpClass:
    kind: OpKind
    reduce_axes: tuple = ()  # axes reduced on the reduction's input
    reduce_where: str = ""  # row | column | middle | full
    expensive: tuple = ()  # expensive intrinsics evaluated per element
    reason: str = ""  # why compute-intensive or unsupported

    def describe(self) -> str:
        if self.kind == OpKind.REDUCTION:
            return f"{self.reduce_where} reduction{list(self.reduce_axes)}"
        if self.reason:
            return f"{self.kind.value} ({self.reason})"
        return self.kind.value


def _reduce_reads(view: BlockView):
    reduce_vars = {v for v, r in zip(view.iter_vars, view.is_reduce) if r}
    return [a for a in view.reads if any(vars_in(i) & reduce_vars for i in a.indices)], reduce_vars


def _is_matmul_like(view: BlockView) -> bool:
    """Two tensors read through the reduce axes, each reused across an output iterator."""
    reads, _ = _reduce_reads(view)
    if len({id(a.buffer) for a in reads}) < 2:
        return False
    spatial = [v for v, r in zip(view.iter_vars, view.is_reduce) if not r]
    used = [set().union(*(vars_in(i) for i in a.indices)) for a in reads]
    return any(any(s not in u for s in spatial) for u in used)


def _is_small_gemm(view: BlockView) -> bool:
    """A batched matmul one of whose operands has a statically small side: the output iterators
    that only that operand's reads use span fewer than MMA_NARROW_SIDE elements. Batched:
    both operands share an output iterator, so the other one is streamed once per batch (a linear
    layer's unbatched weight stays a GEMM for dlight). Every index a plain iterator or constant
    (a convolution's windows are not)."""
    reads, _ = _reduce_reads(view)
    buffers = {id(a.buffer): a.buffer for a in reads}
    plain = all(isinstance(i, (tirx.Var, tirx.IntImm)) for a in reads for i in a.indices)
    if len(buffers) != 2 or not plain:
        return False
    used = {key: set() for key in buffers}
    for a in reads:
        used[id(a.buffer)] |= set().union(*(vars_in(i) for i in a.indices))
    first, second = used.values()
    spatial = [(v, e) for v, e, r in zip(view.iter_vars, view.extents, view.is_reduce) if not r]
    if not any(v in first and v in second for v, _ in spatial):
        return False
    for mine, other in ((first, second), (second, first)):
        side = static_product(e for v, e in spatial if v in mine and v not in other)
        if side is not None and side < MMA_NARROW_SIDE:
            return True
    return False


# `tvm_stitch.schedule_rule` of a GEMM scheduled on tensor cores (schedules/cuda/tensor_core_matmul).
TENSOR_CORE_RULE = "tensor_core_matmul"


def _is_large_contraction(view: BlockView) -> bool:
    return view.has_reduction and _is_matmul_like(view) and not _is_small_gemm(view)


def _reduction_axes(view: BlockView) -> tuple:
    reads, reduce_vars = _reduce_reads(view)
    if not reads:
        return (), "full"
    access = max(reads, key=lambda a: len(a.indices))
    axes = tuple(d for d, idx in enumerate(access.indices) if vars_in(idx) & reduce_vars)
    rank = len(access.indices)
    if len(axes) == rank:
        where = "full"
    elif axes[-1] == rank - 1:
        where = "row"
    elif axes[0] == 0:
        where = "column"
    else:
        where = "middle"
    return axes, where


def _spatial_kind(view: BlockView) -> OpKind:
    write = view.writes[0]
    out_index = list(write.indices)
    kind = OpKind.ELEMENTWISE
    for read in view.reads:
        idx = list(read.indices)
        if len(idx) == len(out_index) and all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(idx, out_index)
        ):
            continue
        out_vars = [i for i in out_index if isinstance(i, tirx.Var)]
        positions = []
        broadcast = True
        for i in idx:
            if isinstance(i, tirx.IntImm):
                continue
            if isinstance(i, tirx.Var) and any(i.same_as(o) for o in out_vars):
                positions.append(next(k for k, o in enumerate(out_vars) if i.same_as(o)))
            else:
                broadcast = False
        if broadcast and positions == sorted(positions):
            kind = OpKind.BROADCAST
        else:
            return OpKind.INJECTIVE
    return kind


def classify_views(views: list) -> OpClass:
    if not views:
        return OpClass(OpKind.UNSUPPORTED, reason="no blocks")
    expensive = tuple(sorted({name for v in views for name in v.expensive}))
    for view in views:
        if not view.trivial_binding:
            return OpClass(OpKind.UNSUPPORTED, reason=f"block {view.name} has a non-trivial loop nest")
        if not view.writes or any(a.kind == REGION for a in view.reads + view.writes):
            return OpClass(OpKind.UNSUPPORTED, reason=f"block {view.name} accesses a region, not elements")
        if _is_large_contraction(view):
            return OpClass(OpKind.COMPUTE, reason=f"block {view.name} contracts two tensors")
    reductions = [v for v in views if v.has_reduction]
    if reductions:
        axes, where = _reduction_axes(reductions[0])
        for other in reductions[1:]:
            _, other_where = _reduction_axes(other)
            if other_where != where:
                where = "mixed"
        return OpClass(OpKind.REDUCTION, axes, where, expensive)
    order = [OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.INJECTIVE]
    kind = max((_spatial_kind(v) for v in views), key=order.index)
    return OpClass(kind, expensive=expensive)


def is_compute_kernel(func: tirx.PrimFunc) -> bool:
    """Whether a (possibly scheduled) PrimFunc contracts two tensors somewhere (matmul, conv; a fused
    attention kernel, rewrites/attention.py, contracts two pairs; a GEMM on tensor cores, whose
    contraction is an intrinsic call once scheduled)."""
    if func.attrs is not None and ("tvm_stitch.attention" in func.attrs
                                   or func.attrs.get("tvm_stitch.schedule_rule") == TENSOR_CORE_RULE):
        return True
    return any(_is_large_contraction(view) for view in all_block_views(func))


def classify_primfunc(func: tirx.PrimFunc) -> OpClass:
    """Classify one legalized operator (or a fused group) from its blocks."""
    if not isinstance(func, tirx.PrimFunc):
        return OpClass(OpKind.UNSUPPORTED, reason="not a PrimFunc")
    pattern = func.attrs.get("op_pattern") if func.attrs is not None else None
    if pattern is not None and int(pattern) == 5:
        # kTuple: a function that only packs its inputs.
        return OpClass(OpKind.UNSUPPORTED, reason="tuple pattern")
    try:
        views = function_views(func)
    except (RuntimeError, ValueError) as err:  # TIR outside what schedules can describe
        return OpClass(OpKind.UNSUPPORTED, reason=f"unreadable TIR: {type(err).__name__}")
    return classify_views(views)
