"""The row-resident scheme's rules every target shares: the analysis no rank changes, the rows.

The leading aligned axes are rows; one row task (a CUDA thread block, a CPU
loop iteration) computes every block for its row. Per block the analysis
chooses where its result lives:
- inlined into consumers (register level) when it is cheap element-wise or
  injective work and not a kernel output;
- on chip (shared memory on CUDA, a per-row buffer on CPU) when it is a
  reduction result, holds an expensive op (computed once, never
  recomputed), depends on a gather (reads through computed indices, which
  no aligned row cache serves) and is read more than once per element, or
  is a kernel output that other blocks also read;
- kernel outputs are written to global memory.
What differs per target (a kernel output's level, arithmetic the target
emulates) comes in a `LevelRules` record; the rank rule, the mapping and what
stays on chip are the target's (planning/cuda/, planning/cpu/). Anything the
scheme cannot express raises PlanError with the reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from tvm import tirx

from tvm_stitch.analysis.row_alignment import analyze_rows, walks_columns
from tvm_stitch.analysis.size_bounds import size_bounds, upper_bound
from tvm_stitch.analysis.tir_view import (GATHER, block_consumers, buffer_params, static_int,
                                          static_product, vars_in)
from tvm_stitch.planning.common import Analyses, PlanError, check_describable, inline_trial, output_blocks
from tvm_stitch.planning.common import views as views_of
from tvm_stitch.planning.plan import GLOBAL, REGISTER, SHARED, Intermediate, StitchPlan
from tvm_stitch.planning.spec import TargetSpec

LARGE_WORK = 1 << 20  # elements above which a kernel must have a row axis to spread over
INLINE = "inlined"  # planner-internal: register level, recomputed in each consumer


@dataclass(frozen=True)
class LevelRules:
    """What a target decides about levels: where a kernel output read inside the kernel lives
    (level, why), and the dtypes whose arithmetic it emulates (recomputing them is not cheap)."""

    output: tuple
    emulated: tuple = ()


def _level(view, consumers: list, levels: dict, evaluations: dict, is_output: bool,
           rules: LevelRules, gathered: bool) -> tuple:
    """Where a block's result lives, given the levels already chosen for its consumers.

    `evaluations[c]` is how often consumer c is evaluated per element of its
    own result when inlined; an expensive or `gathered` block (one whose value
    depends on a read through computed indices) is inlined only if that makes
    it evaluated once per element.
    """
    if is_output:
        return rules.output
    if view.has_reduction:
        return SHARED, "reduction result broadcast over its row"
    if len(view.writes) != 1:
        return SHARED, "block writes several buffers"
    emulated = str(view.writes[0].buffer.dtype) in rules.emulated
    if not view.expensive and not emulated and not gathered:
        return INLINE, "cheap: recomputed in each consumer"
    if _evaluations(view, consumers, levels, evaluations) == 1:
        what = ", ".join(view.expensive) or "a gathered value"
        return INLINE, f"{what} evaluated once, inlined into its consumer"
    if gathered and not view.expensive and not emulated:
        return SHARED, "gathered once: reads through computed indices, kept for its several uses"
    if emulated:
        return SHARED, f"computed once: {view.writes[0].buffer.dtype} arithmetic is emulated on the CPU"
    return SHARED, f"computed once: {', '.join(view.expensive)}"


def _evaluations(view, consumers: list, levels: dict, evaluations: dict) -> int:
    buffer = view.writes[0].buffer
    return sum(
        c.loads_of(buffer) * (evaluations.get(c.name, 1) if levels.get(c.name, (GLOBAL,))[0] == INLINE else 1)
        for c in consumers
    )


def row_elements(extents, bounds: dict) -> int | None:
    """Elements of a row of `extents`: their product, or its upper bound over the sizes' `bounds`
    (None when a size is unbounded)."""
    extents = list(extents)
    static = static_product(extents)
    if static is not None or not bounds:
        return static
    total = extents[0]
    for extent in extents[1:]:
        total = total * extent
    return upper_bound(total, bounds)


def row_bytes(buffer, rank: int, bounds: dict) -> int | None:
    """Bytes of one row of `buffer` under `rank` row axes (None when of unbounded symbolic size)."""
    per_row = row_elements(buffer.shape[rank:], bounds)
    return None if per_row is None else per_row * max(1, buffer.dtype.bits // 8)


def _levels(views: list, outputs: set, rules: LevelRules, recompute: tuple = (),
            gathered: set = frozenset()) -> dict:
    """Level and reason for every block whose result is read inside the kernel, last block first.

    Blocks in `recompute` are inlined although expensive: demoted from shared memory.
    Blocks in `gathered` are kept on chip when read more than once per element.
    """
    consumers = block_consumers(views)
    by_name = {view.name: view for view in views}
    levels, evaluations = {}, {}
    for view in reversed(views):
        if not consumers[view.name]:
            continue
        users = [by_name[c] for c in consumers[view.name]]
        if view.name in recompute:
            levels[view.name] = (INLINE, "demoted from shared memory (the row does not fit): "
                                         "recomputed in each consumer")
        else:
            levels[view.name] = _level(view, users, levels, evaluations, view.name in outputs, rules,
                                       view.name in gathered)
        if levels[view.name][0] == INLINE:
            evaluations[view.name] = max(1, _evaluations(view, users, levels, evaluations))
    return levels


def _gathered(views: list) -> set:
    """Names of the blocks whose value depends on a read through computed indices (a `take`,
    a concat), directly or through the blocks they read."""
    out = set()
    for view in views:
        producers = [p for p in views if p.name in out]
        if any(a.kind == GATHER for a in view.reads) or any(
                r.buffer.same_as(w.buffer) for p in producers for w in p.writes for r in view.reads):
            out.add(view.name)
    return out


def _kept_rows(func: tirx.PrimFunc, views: list, levels: dict, analyses: Analyses | None = None) -> tuple:
    """(kept blocks, their row alignment) once the register-level blocks are inlined: those decide the rows."""
    names = [v.name for v in views if levels.get(v.name, (GLOBAL,))[0] == INLINE]
    trial, kept = inline_trial(func, names, analyses=analyses)
    check_describable(kept)
    return kept, analyze_rows(trial.mod["main"], kept)


@dataclass(frozen=True)
class Analysis:
    """The part of a row-resident plan that no rank changes: made once per fused PrimFunc,
    family and demotions, and passed to every plan made from it (candidates re-plan at other ranks)."""

    func: tirx.PrimFunc
    family: str
    recompute: tuple  # blocks demoted from shared memory to recomputation
    views: tuple  # every block
    outputs: frozenset  # blocks that write the kernel's outputs
    levels: dict  # block -> (level, why), for blocks read inside the kernel
    kept: tuple  # the blocks left once the register-level ones are inlined
    depth: int  # aligned row depth of the kept blocks
    depth_limit: str  # why the aligned depth stops there (the row alignment's reason)


def analyse(func: tirx.PrimFunc, family: str, rules: LevelRules, recompute: tuple = (),
            analyses: Analyses | None = None) -> Analysis:
    """The rank-independent analysis of a fused PrimFunc under the target's level `rules`
    (PlanError if the scheme cannot hold it); made once per `analyses`."""
    if analyses is not None:
        return analyses.made(func, ("analysis", family, tuple(recompute)),
                             lambda: _analysis(func, family, rules, tuple(recompute), analyses))
    return _analysis(func, family, rules, tuple(recompute), None)


def _analysis(func: tirx.PrimFunc, family: str, rules: LevelRules, recompute: tuple,
              analyses: Analyses | None) -> Analysis:
    views = views_of(func, analyses)
    check_describable(views)
    outputs = output_blocks(views, func)
    gathered = _gathered(views)
    levels = _levels(views, outputs, rules, recompute, gathered)
    kept, rows = _kept_rows(func, views, levels, analyses)
    if any(levels[name][0] != INLINE for name in gathered if name in levels):
        # A gathered result kept on chip may be read across rows, where recomputed it would not be.
        inlined = _levels(views, outputs, rules, recompute)
        kept_inlined, rows_inlined = _kept_rows(func, views, inlined, analyses)
        if rows_inlined.depth > rows.depth:
            levels, kept, rows = inlined, kept_inlined, rows_inlined
    return Analysis(func, family, tuple(recompute), tuple(views), frozenset(outputs), levels, tuple(kept), rows.depth,
                    rows.limit)


def check_analysis(analysis: Analysis, func: tirx.PrimFunc, family: str, recompute: tuple) -> None:
    """ValueError unless `analysis` was made for `func`, `family` and the demotions `recompute`."""
    if not (analysis.func.same_as(func) and (analysis.family, analysis.recompute) == (family, tuple(recompute))):
        raise ValueError("the analysis passed was made for another function, family or demotion")


@dataclass(frozen=True)
class Rows:
    """The row axes chosen for a plan and what they leave inside a row."""

    rank: int
    extents: tuple  # PrimExpr per row axis
    rows: int | None  # row tasks (None: symbolic)
    within_max: int | None  # the most elements a kept block has inside one row (None: a symbolic length)
    spatial_only: bool  # no kept block reduces
    columns: bool  # some block walks an input along a strided axis
    # Symbolic row lengths planned for their upper bound: the sizes' bounds ({name: (lower, upper)})
    # and the (size, upper bound) pairs inside a row; empty for static or unbounded lengths.
    bounds: dict = dataclasses.field(default_factory=dict)
    bounded: tuple = ()


def static_within_rank(views: list, depth: int) -> int:
    """The fewest leading axes (at least 1) outside which no block has a symbolic extent.

    Symbolic axes (batch, sequence) become rows where the aligned depth allows:
    the grid then follows the runtime extent while each row keeps a static length.
    """
    rank = 1
    for view in views:
        for axis, extent in enumerate(view.extents[:depth]):
            if static_int(extent) is None:
                rank = max(rank, axis + 1)
    return min(rank, max(1, depth))


def choose_rows(analysis: Analysis, rank: int | None, choose_rank: Callable, use_bounds: bool,
                streams_symbolic: bool = False) -> Rows:
    """The rows of a plan at `rank` leading axes (None: `choose_rank(kept, depth, spatial_only)`, the
    target's rule). With `use_bounds`, a symbolic row length with an upper bound is planned as a
    static row of the bound (softmax over a key length of at most 128). With `streams_symbolic`,
    a symbolic count in one row task (a loss mean over a symbolic batch) is planned as one task
    that streams it, for any count, where TVM's path runs it in single-thread kernels."""
    kept, depth = list(analysis.kept), analysis.depth
    spatial_only = not any(v.has_reduction for v in kept)
    if rank is None:
        rank = choose_rank(kept, depth, spatial_only)
    elif not min(1, depth) <= rank <= depth:
        raise PlanError("rank-outside-depth", rank=rank, depth=depth)
    sizes = [static_product(v.extents) for v in kept]
    streamed = streams_symbolic and None in sizes
    if rank == 0 and not streamed and (None in sizes or max(sizes) >= LARGE_WORK):
        raise PlanError("no-row-axis", limit=analysis.depth_limit, elements=None if None in sizes else max(sizes))
    within = [static_product(view.extents[rank:]) for view in kept]
    bounds, bounded = {}, ()
    if None in within and use_bounds:
        bounds = size_bounds(analysis.func)
        within = [row_elements(view.extents[rank:], bounds) for view in kept]
        inside = {v.name for view in kept for e in view.extents[rank:] for v in vars_in(e)}
        bounded = tuple(sorted((name, bounds[name][1]) for name in inside if name in bounds))
        if None in within:
            bounds, bounded = {}, ()
    # None: a symbolic row length without an upper bound; planned for any length.
    within_max = None if None in within else max([1] + within)
    row_extents = kept[0].extents[:rank]
    return Rows(rank, tuple(row_extents), static_product(row_extents), within_max, spatial_only,
                walks_columns(kept, buffer_params(analysis.func), rank), bounds, bounded)


def intermediates(analysis: Analysis, rank: int, thread_per_row: bool, bounds: dict) -> tuple:
    """(intermediates, bytes per row of each shared one, shared ones of unbounded symbolic size) for
    the levels chosen, at `rank` row axes; a row of symbolic length within `bounds` takes its bound.
    With `thread_per_row` (one thread holds a whole row) nothing is shared: kept in that thread."""
    kept_by_name = {v.name: v for v in analysis.kept}
    out, shared_rows, symbolic = [], [], []
    for view in analysis.views:
        if view.name not in analysis.levels:
            continue
        level, why = analysis.levels[view.name]
        per_row = 1
        if view.name in kept_by_name:
            kept_view = kept_by_name[view.name]
            per_row = row_elements((e for e, r in zip(kept_view.extents[rank:], kept_view.is_reduce[rank:]) if not r),
                                   bounds)
        nbytes = (per_row or 1) * max(1, view.writes[0].buffer.dtype.bits // 8)
        if level == SHARED and thread_per_row:
            level, why = REGISTER, f"{why}; one thread per row: kept in that thread"
        if level == SHARED and per_row is None:
            symbolic.append(view.name)
        elif level == SHARED:
            shared_rows.append(nbytes)
        out.append(Intermediate(view.name, REGISTER if level == INLINE else level, nbytes, why,
                                inlined=level == INLINE))
    return out, shared_rows, symbolic


def assemble(analysis: Analysis, rows: Rows, inter: list, spec: TargetSpec, name: str, mapping) -> StitchPlan:
    """The row-resident StitchPlan from the analysis, the rows, the intermediates and the target's
    mapping record (its `notes` and the plan fields it sets, `plan_fields()`)."""
    views = analysis.views
    dominant = tuple(v.name for v in views if v.has_reduction) or tuple(
        v.name for v in views if v.expensive
    ) or (views[-1].name,)
    notes = tuple(mapping.notes)
    if rows.rank == 0:
        notes += ("no shared row axis: the whole kernel is one row task",)
    return StitchPlan(
        kernel=name,
        target=spec.family,
        scheme="row-resident",
        ops=tuple(v.name for v in views),
        dominant=dominant,
        rank=rows.rank,
        row_shape=tuple(str(static_int(e) if static_int(e) is not None else e) for e in rows.extents),
        intermediates=tuple(inter),
        outputs=tuple(v.name for v in views if v.name in analysis.outputs),
        reductions=sum(1 for v in views if v.has_reduction),
        notes=notes,
        aligned_depth=analysis.depth,
        bounds=rows.bounded,
        spec=spec,
        **mapping.plan_fields(),
    )
