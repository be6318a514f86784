"""Row alignment: which leading axes a set of blocks can share as "rows".

A group of blocks can be stitched row-resident at rank r when every block's
first r iterators are spatial with the same extents (the rows), every write
puts row i at tensor index [i, ...], and every read of a tensor produced
inside the group takes row i from index [i, ...] too. Then one row of every
intermediate is produced and consumed by the same row task (a CUDA thread
block, a CPU loop iteration), and intermediates never cross rows.

Reads of tensors from outside the group may cross rows freely (a broadcast
gamma, a transposed weight, a gather through computed or loaded indices:
an embedding lookup, a concat, a pad): they are read from global memory.
A read of an intermediate through computed indices is aligned when its row
indices are the row iterators themselves (a rotated half of the row); any
other (a `take` of rows of an intermediate) crosses rows and ends the
aligned depth, with the reason recorded.

In a PrimFunc whose row axes were moved first (`row_axes.rows_first`, marked
with ROW_AXES_ATTR) the kernel's parameters keep their layout: a parameter
is then row-aligned when each row iterator indexes one of its dimensions
(alone, or as r * k + e over a slice), the same dimensions in every access
(a row task writes the strided slice y[:, c, :, :] and reads back only that
slice).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import tirx

from tvm_stitch.analysis.row_axes import ROW_AXES_ATTR, row_dims
from tvm_stitch.analysis.tir_view import Access, BlockView, buffer_params, function_views, static_int, vars_in

ALIGNED = "aligned"
INVARIANT = "invariant"
CROSSING = "crossing"


def access_kind(access: Access, row_vars: tuple) -> str:
    """How one access relates to the row iterators of its block."""
    if not row_vars:
        return ALIGNED
    used = [vars_in(i) for i in access.indices]
    rows = set(row_vars)
    if not any(u & rows for u in used):
        return INVARIANT
    if len(access.indices) >= len(row_vars) and all(
        isinstance(access.indices[d], tirx.Var) and access.indices[d].same_as(row_vars[d])
        for d in range(len(row_vars))
    ) and not any(u & rows for u in used[len(row_vars):]):
        return ALIGNED
    return CROSSING


def _worst(kinds) -> str:
    kinds = set(kinds)
    if CROSSING in kinds:
        return CROSSING
    if ALIGNED in kinds and INVARIANT in kinds:
        return CROSSING
    return kinds.pop() if kinds else INVARIANT


def _leading_spatial(view: BlockView) -> list:
    lead = []
    for extent, reduce in zip(view.extents, view.is_reduce):
        if reduce:
            break
        lead.append(extent)
    return lead


def common_row_extents(views: list) -> tuple:
    """The longest prefix of spatial extents shared by all blocks."""
    if not views:
        return ()
    leads = [_leading_spatial(v) for v in views]
    prefix = []
    for d in range(min(len(lead) for lead in leads)):
        first = leads[0][d]
        if all(tvm_ffi.structural_equal(lead[d], first) for lead in leads[1:]):
            prefix.append(first)
        else:
            break
    return tuple(prefix)


def _extents_differ(views: list, axis: int) -> str:
    """Where the blocks' leading spatial extents stop agreeing, at `axis` ("" when some block has none left)."""
    distinct = {}
    for view in views:
        lead = _leading_spatial(view)
        if len(lead) <= axis:
            return ""
        extent = static_int(lead[axis])
        distinct.setdefault(str(lead[axis]) if extent is None else str(extent), view.name)
    shown = ", ".join(f"{extent} ({name})" for extent, name in list(distinct.items())[:3])
    return f"the blocks' extents differ at axis {axis}: {shown}"


@dataclass(frozen=True)
class RowInfo:
    """Row alignment of one PrimFunc.

    `extents[:r]` are the rows at rank r, for every r <= depth.
    `param_access[p][r]` says how parameter p is accessed at rank r.
    """

    extents: tuple  # int per leading extent, up to depth; None where symbolic
    exprs: tuple  # the same extents printed, to compare rows (symbolic ones by name)
    depth: int
    param_access: tuple  # per param: tuple of kinds for r = 0..depth
    limit: str = ""  # why the aligned depth stops where it does ("" when every leading axis is a row)


def _misaligned(views: list, param_buffers: list, rank: int, strided_params: bool = False) -> str:
    """The first write, or read of something other than a pure input (a parameter no block
    writes), that does not keep row i at index [i, ...] at `rank`; "" when none.

    A parameter that is also written is a kernel output read back inside the
    kernel: another row task may not have written the row it wants yet.
    `strided_params`: parameters may hold the rows at any dimensions, the same in every access.
    """
    written = [w.buffer for v in views for w in v.writes]
    inputs = [b for b in param_buffers if not any(b.same_as(w) for w in written)]
    param_dims = []  # (parameter, dimensions of its rows)
    for view in views:
        row_vars = view.iter_vars[:rank]
        for write in view.writes:
            if strided_params and any(write.buffer.same_as(p) for p in param_buffers):
                if not _strided_row(write, view, row_vars, param_dims):
                    return f"block {view.name} writes {write.buffer.name} across rows"
            elif access_kind(write, row_vars) != ALIGNED:
                return f"block {view.name} writes {write.buffer.name} across rows"
        for read in view.reads:
            if any(read.buffer.same_as(b) for b in inputs):
                continue
            if strided_params and any(read.buffer.same_as(p) for p in param_buffers):
                aligned = _strided_row(read, view, row_vars, param_dims)
            else:
                aligned = access_kind(read, row_vars) == ALIGNED
            if not aligned:
                return (f"block {view.name} reads {read.buffer.name} [{', '.join(str(i) for i in read.indices)}] "
                        f"({read.kind} access) across rows")
    return ""


def _strided_row(access: Access, view: BlockView, row_vars: tuple, param_dims: list) -> bool:
    """A parameter's access holds each row at one dimension, the same in every access
    (`param_dims`: (parameter, dimensions) found so far, extended)."""
    dims = row_dims(access, row_vars, view)
    known = next((d for p, d in param_dims if p.same_as(access.buffer)), None)
    if dims is None or known not in (None, dims):
        return False
    param_dims.append((access.buffer, dims))
    return True


def analyze_rows(func: tirx.PrimFunc, views: list | None = None) -> RowInfo:
    """Row alignment of a PrimFunc's blocks, for every usable rank."""
    if views is None:
        views = function_views(func)
    param_buffers = buffer_params(func)
    extents = common_row_extents(views)
    strided = func.attrs is not None and ROW_AXES_ATTR in func.attrs
    depth, limit = 0, ""
    for rank in range(1, len(extents) + 1):
        limit = _misaligned(views, param_buffers, rank, strided)
        if limit:
            break
        depth = rank
    access = []
    for buf in param_buffers:
        per_rank = []
        for rank in range(depth + 1):
            kinds = [
                access_kind(a, v.iter_vars[:rank])
                for v in views
                for a in v.reads + v.writes
                if a.buffer.same_as(buf)
            ]
            per_rank.append(_worst(kinds) if kinds else INVARIANT)
        access.append(tuple(per_rank))
    leading = extents[:depth]
    if not limit:
        limit = _extents_differ(views, len(extents))
    return RowInfo(tuple(static_int(e) for e in leading), tuple(str(e) for e in leading), depth, tuple(access),
                   limit)


def walks_columns(views: list, params: list, rank: int) -> bool:
    """Some block steps through an input along a non-contiguous axis while rows are contiguous."""
    if rank == 0:
        return False
    for view in views:
        row_vars = set(view.iter_vars[:rank])
        within = set(view.iter_vars[rank:])
        if not within:
            continue
        for read in view.reads:
            if not any(read.buffer.same_as(p) for p in params) or not read.indices:
                continue
            if access_kind(read, view.iter_vars[:rank]) == ALIGNED:
                continue
            last = vars_in(read.indices[-1])
            if last & row_vars and not last & within and any(vars_in(i) & within for i in read.indices[:-1]):
                return True
    return False
