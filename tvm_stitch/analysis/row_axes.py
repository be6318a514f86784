"""Row axes that are not leading: find them and move them first.

Row-resident and row-split stitching take the rows from the leading axes
every block shares. A reduction whose kept axis sits in the middle
(BatchNorm on NCHW: statistics over N, H, W per channel C) shares no leading
axis with its element-wise consumers: the reduction iterates (1, C, 1, 1 | N,
H, W), the consumers (N, C, H, W). The channel is still a row: every block
has one iterator for it, and every tensor produced inside the kernel holds
it at one dimension, read and written at that dimension by plain iterators.

`find_row_axes` finds such a set of axes, seeded by the first reduction's
kept (non-unit) iterators and followed through the tensors the kernel
produces; `rows_first` rewrites the PrimFunc so that in every block those
iterators come first (s_tir `transform_block_layout`) and every buffer the
kernel allocates holds them first (`transform_layout`). The kernel's
parameters keep their layout: a row task then reads and writes a strided
slice (y[:, c, :, :]), which `row_alignment` accepts for parameters of a
function marked with ROW_AXES_ATTR. The plan records the axes as plain data
(block name, iterator positions) and the schedules redo the same rewrite.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx

from tvm_stitch.analysis.tir_view import block_views, function_views, buffer_params, static_int, vars_in

ROW_AXES_ATTR = "tvm_stitch.row_axes"  # on a rewritten PrimFunc: its rows were moved first


def _simplifier(view):
    """(simplify, analyzer) of a block's indices: its unit iterators set to 0 (a reshape's index
    (c + h + w) % C over unit h, w is then the plain c), the others bound to their ranges;
    without a view, identity and an empty analyzer."""
    analyzer = sym.Analyzer()
    if view is None:
        return (lambda index: index), analyzer
    for var, extent in zip(view.iter_vars, view.extents):
        if static_int(extent) == 1:
            analyzer.bind(var, tirx.const(0, var.ty))
        else:
            analyzer.bind(var, tvm.ir.Range.from_min_extent(0, extent))
    return (lambda index: index if isinstance(index, tirx.Var) else analyzer.simplify(index)), analyzer


def _scaled(index, var, analyzer) -> bool:
    """`index` is var * k + e with e free of `var` and 0 <= e < k: distinct values of var index
    disjoint slices (a channel group's channels, c = g * C/G + r)."""
    if not isinstance(index, tirx.Add):
        return False
    for scaled, rest in ((index.a, index.b), (index.b, index.a)):
        if (isinstance(scaled, tirx.Mul) and isinstance(scaled.a, tirx.Var) and scaled.a.same_as(var)
                and isinstance(scaled.b, tirx.IntImm) and var not in vars_in(rest)):
            bound = analyzer.const_int_bound(rest)
            if bound.min_value >= 0 and bound.max_value < scaled.b.value:
                return True
    return False


def row_dims(access, row_vars: tuple, view=None) -> tuple | None:
    """The dimension of `access` that each row iterator indexes, in row order: alone, or with
    the accessing block's `view`, as var * k + e over a slice 0 <= e < k (its unit iterators set
    to 0); None if one has none, or if a row iterator also appears in another index."""
    simple, analyzer = _simplifier(view)
    indices = [simple(i) for i in access.indices]
    dims = []
    for var in row_vars:
        found = [d for d, index in enumerate(indices) if isinstance(index, tirx.Var) and index.same_as(var)]
        if not found and view is not None:
            found = [d for d, index in enumerate(indices) if _scaled(index, var, analyzer)]
        if len(found) != 1:
            return None
        dims.append(found[0])
    rows = set(row_vars)
    if any(vars_in(index) & rows for d, index in enumerate(indices) if d not in dims):
        return None
    return tuple(dims)


def _spec_dims(access, view, specs: tuple) -> tuple | None:
    """The dimension of `access` indexed by each row of `specs` ((iterator position, factor):
    the iterator, or with a factor k its quotient by k), in row order; an iterator split by k may
    appear elsewhere only as its remainder by k. None where that does not hold."""
    simple, _ = _simplifier(view)
    indices = [simple(i) for i in access.indices]
    dims = []
    for position, factor in specs:
        var = view.iter_vars[position]
        found = [d for d, index in enumerate(indices) if _is_row(index, var, factor)]
        if len(found) != 1:
            return None
        dims.append(found[0])
    for d, index in enumerate(indices):
        if d in dims:
            continue
        for position, factor in specs:
            var = view.iter_vars[position]
            if var in vars_in(index) and not (factor and isinstance(index, tirx.FloorMod) and index.a.same_as(var)
                                               and isinstance(index.b, tirx.IntImm) and index.b.value == factor):
                return None
    return tuple(dims)


def _is_row(index, var, factor: int) -> bool:
    """`index` holds the row `var` (with a factor k: var // k, or var itself, whose values for
    one quotient are the row's slice of k)."""
    if not factor or (isinstance(index, tirx.Var) and index.same_as(var)):
        return isinstance(index, tirx.Var) and index.same_as(var)
    return (isinstance(index, tirx.FloorDiv) and isinstance(index.a, tirx.Var) and index.a.same_as(var)
            and isinstance(index.b, tirx.IntImm) and index.b.value == factor)


def _rows_from(view, access, dims: tuple) -> tuple | None:
    """The row specs ((position, factor) per row) of `view` that index `access` at `dims`: a
    spatial iterator, or its quotient by a constant that divides its extent (the output of a
    GroupNorm reads its group's statistics at c // (C/G))."""
    specs = []
    simple, _ = _simplifier(view)
    for dim in dims:
        index = simple(access.indices[dim])
        factor = 0
        if (isinstance(index, tirx.FloorDiv) and isinstance(index.a, tirx.Var) and isinstance(index.b, tirx.IntImm)
                and index.b.value > 1):
            index, factor = index.a, int(index.b.value)
        position = next((p for p, v in enumerate(view.iter_vars) if isinstance(index, tirx.Var) and v.same_as(index)),
                        None)
        if position is None or view.is_reduce[position]:
            return None
        extent = static_int(view.extents[position])
        if factor and (extent is None or extent % factor):
            return None
        specs.append((position, factor))
    return tuple(specs) if len({p for p, _ in specs}) == len(specs) else None


def _seed_rows(view) -> tuple:
    """A reduction's kept iterators of extent above 1: the rows it offers, as row specs."""
    return tuple((p, 0) for p, (e, r) in enumerate(zip(view.extents, view.is_reduce)) if not r and static_int(e) != 1)


def _propagate(views: list, free: list, rows: dict, dims: list) -> bool:
    """Place every block it can: extend `rows` (block name -> row specs: (iterator position, factor)) and
    `dims` ((buffer, dimensions holding the rows) of the tensors blocks share) from what they hold,
    leaving the buffers in `free` (read across rows) aside. False on a conflict: a tensor whose
    rows two blocks put at different dimensions, or a placed block that reaches a tensor through
    something other than its plain row iterators."""
    def dims_for(buffer):
        return next((d for b, d in dims if b.same_as(buffer)), None)

    changed = True
    while changed:
        changed = False
        for view in views:
            accesses = [a for a in view.reads + view.writes if not any(a.buffer.same_as(f) for f in free)]
            if view.name not in rows:
                for access in accesses:
                    known = dims_for(access.buffer)
                    found = None if known is None else _rows_from(view, access, known)
                    if found is not None:
                        rows[view.name] = found
                        changed = True
                        break
            if view.name not in rows:
                continue
            for access in accesses:
                found = _spec_dims(access, view, rows[view.name])
                known = dims_for(access.buffer)
                if found is None or known not in (None, found):
                    return False
                if known is None:
                    dims.append((access.buffer, found))
                    changed = True
    return True


def _row_extents(views: list, rows: dict) -> tuple | None:
    """The row extents every block shares (None if a block is not placed or they differ)."""
    if len(rows) != len(views):
        return None
    def extents_of(view):
        return tuple(view.extents[p] if not k else tirx.const(static_int(view.extents[p]) // k, view.extents[p].ty)
                     for p, k in rows[view.name])

    extents = extents_of(views[0])
    for view in views[1:]:
        if not tvm_ffi.structural_equal(extents_of(view), extents):
            return None
    return extents


def find_row_axes(func: tirx.PrimFunc) -> tuple | None:
    """Per block (name, positions of its row iterators, factors), in program order, or None.

    The rows are the first reduction's spatial iterators of extent above 1;
    every other block's (but element-wise blocks of inputs alone that write
    no output, read like inputs and left in place) are the iterators that index the same
    dimensions of the tensors it shares with blocks already placed, or their quotients by
    a factor (0: the iterator itself; k: the iterator is split into its
    quotient by k, a row, and its remainder). None when a block has no such
    iterators, when their extents differ between blocks, when the rows are
    already the leading iterators of every block, or when the kernel does
    not reduce.
    """
    views = function_views(func)
    seed = next((v for v in views if v.has_reduction), None)
    positions = () if seed is None else _seed_rows(seed)
    if not positions:
        return None
    params = buffer_params(func)
    free = [p for p in params if not any(w.buffer.same_as(p) for v in views for w in v.writes)]
    placed = []
    for view in views:  # element-wise blocks of inputs alone (a reshaped gamma): read like inputs
        writes_output = any(w.buffer.same_as(p) for w in view.writes for p in params)
        if (not view.has_reduction and not writes_output
                and all(any(r.buffer.same_as(f) for f in free) for r in view.reads)):
            free.extend(w.buffer for w in view.writes)
        else:
            placed.append(view)
    rows = {seed.name: positions}
    if not _propagate(placed, free, rows, []) or _row_extents(placed, rows) is None:
        return None
    if all(rows[v.name] == tuple((p, 0) for p in range(len(positions))) for v in placed):
        return None
    return tuple((v.name, tuple(p for p, _ in rows[v.name]), tuple(k for _, k in rows[v.name])) for v in placed)


def _op_dims(func: tirx.PrimFunc, seeds: dict, free: set, seed_reduction: bool) -> tuple | None:
    """(dims per parameter position, row extents) of one op's PrimFunc, from the dimensions
    `seeds` gives some parameters (or, with `seed_reduction`, from its first reduction); the
    parameters at positions in `free` are read across rows. None where no consistent rows exist."""
    views = function_views(func)
    params = buffer_params(func)
    rows, dims = {}, [(params[pos], d) for pos, d in seeds.items()]
    if seed_reduction:
        seed = next((v for v in views if v.has_reduction), None)
        if seed is None or not _seed_rows(seed):
            return None
        rows[seed.name] = _seed_rows(seed)
    if not _propagate(views, [params[pos] for pos in free], rows, dims):
        return None
    extents = _row_extents(views, rows)
    if extents is None:
        return None
    found = {pos: next((d for b, d in dims if b.same_as(p)), None) for pos, p in enumerate(params) if pos not in free}
    return None if None in found.values() else (found, extents)


def group_row_count(ops: list, op_ids: set) -> tuple | None:
    """(number of row axes, row extents) that the ops `op_ids` of a graph (analysis/graph.py's
    Op: func, inputs, out_types) share at dimensions that need not lead, as `find_row_axes`
    would find them in the fused kernel; None if they share none.

    Seeded by the first reduction op; then each op with a tensor of known row dimensions
    places its other tensors inside the group, until all are placed. Only groups where a
    reduction's result is read inside the group (BatchNorm: the mean broadcast back over N, H,
    W): where reductions only end the group (column sums), their own leading axes are the rows
    and their producers are inlined, which the leading rows already express.
    """
    order = sorted(op_ids)
    reductions = [i for i in order if any(v.has_reduction for v in function_views(ops[i].func))]
    if not any(r.op in reductions for i in order for r in ops[i].inputs):
        return None
    seed = reductions[0]
    known = {}  # (op, output) -> dims of the rows

    def seeds_of(i):
        op = ops[i]
        seeds = {pos: known[(r.op, r.output)] for pos, r in enumerate(op.inputs) if (r.op, r.output) in known}
        seeds.update({len(op.inputs) + k: known[(i, k)] for k in range(len(op.out_types)) if (i, k) in known})
        return seeds

    extents = None
    pending = [seed] + [i for i in order if i != seed]
    while pending:
        i = next((i for i in pending if i == seed or seeds_of(i)), None)
        if i is None:
            return None
        pending.remove(i)
        op = ops[i]
        free = {pos for pos, r in enumerate(op.inputs) if r.op not in op_ids}
        result = _op_dims(op.func, seeds_of(i), free, i == seed)
        if result is None:
            return None
        found, mine = result
        if extents is not None and not tvm_ffi.structural_equal(mine, extents):
            return None
        extents = mine
        for pos, d in found.items():
            key = (op.inputs[pos].op, op.inputs[pos].output) if pos < len(op.inputs) else (i, pos - len(op.inputs))
            if known.get(key, d) != d:
                return None
            known[key] = d
    return len(extents), extents


def _first(positions: tuple, factors: tuple = ()):
    """The index map that puts the iterators (or dimensions) at `positions` first, the rest in
    order; an iterator with a factor k is split: its quotient by k first, its remainder in its place."""
    factors = factors or (0,) * len(positions)
    split = dict(zip(positions, factors))

    def moved(*indices):
        rows = tuple(indices[p] // k if k else indices[p] for p, k in zip(positions, factors))
        rest = []
        for p, index in enumerate(indices):
            if p not in split:
                rest.append(index)
            elif split[p]:
                rest.append(index % split[p])  # a split row iterator leaves its remainder in place
        return rows + tuple(rest)
    return moved


def rows_first(func: tirx.PrimFunc, row_axes: tuple) -> tirx.PrimFunc:
    """`func` with each block's row iterators (`row_axes`: find_row_axes' answer) first, split
    where the rows are quotients, and each buffer it allocates holding the rows first; marked
    with ROW_AXES_ATTR."""
    sch = s_tir.Schedule(func)
    params = buffer_params(func)
    for name, positions, factors in row_axes:
        block = sch.get_sblock(name)
        if positions != tuple(range(len(positions))) or any(factors):
            iters = sch.get(block).iter_vars
            sch.transform_block_layout(block, tirx.IndexMap.from_func(
                _first(positions, factors), ndim=len(iters), index_dtype=str(iters[0].var.ty)))
    views = {v.name: v for v in block_views(sch)}
    done = []
    for name, positions, _ in row_axes:
        view = views[name]
        row_vars = tuple(view.iter_vars[:len(positions)])
        for index, write in enumerate(view.writes):
            buffer = write.buffer
            if any(buffer.same_as(p) for p in params + done):
                continue
            done.append(buffer)
            dims = row_dims(write, row_vars)
            if dims is not None and dims != tuple(range(len(dims))):
                sch.transform_layout(sch.get_sblock(name), ("write", index), tirx.IndexMap.from_func(
                    _first(dims), ndim=len(buffer.shape), index_dtype=str(buffer.shape[0].ty)))
    return sch.mod["main"].with_attr(ROW_AXES_ATTR, True)
