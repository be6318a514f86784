"""Valid configurations of a stitched group: variants of the rule-based plan.

The rules (planner.py) give one plan; the cost model chooses among the
variants listed here, over the knobs the schedules honour:
- CPU: cores (parallel over rows, or serial), vector lanes (1, half, full
  and double the target's width for the output dtype) and the row axes
  (every rank within the aligned depth whose row tasks hold a vector or
  more, each planned by the planner itself);
- CUDA: threads per block and rows per block, within the thread and shared
  memory limits, scalar accesses instead of vectors, and each on-chip
  intermediate recomputed in its consumers instead of kept in shared memory
  (the planner's demotion, asked for), several elements per thread for an
  element-wise plan of one, and for row-split plans other chunk
  counts per row (SPLIT_FACTORS of the rule's), and for a row-resident plan
  that leaves SMs idle with rows that come through a reshape (GroupNorm's
  groups), row-split plans over those rows (analysis/reshaped_rows.py), and for a
  row-resident plan of a thread per column walk (a reduction over a middle axis) under one wave,
  column tiles with each row cut over threads (planning/cuda/column_tiles.py);
  pricing/timed_choice.py prices them.
Every variant keeps the rule plan's outputs, so it computes the same values;
the first candidate is always the rule plan.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx

from tvm_stitch.analysis.reshaped_rows import reshaping_blocks, rows_through_reshape
from tvm_stitch.analysis.tir_view import buffer_params, static_product
from tvm_stitch.planning.common import Analyses, PlanError, block_threads
from tvm_stitch.planning.cuda.column_tiles import column_tile_plans
from tvm_stitch.planning.cuda.last_block_rows import last_block_plans
from tvm_stitch.planning.plan import MIN_LANES, SHARED, StitchPlan
from tvm_stitch.planning.planner import Analysis, analyse, plan_row_resident
from tvm_stitch.planning.resources import cuda_shared_bytes, with_resources
from tvm_stitch.planning.row_split import plan_row_split
from tvm_stitch.planning.spec import TargetSpec

CUDA_THREADS = (32, 64, 128, 256)  # threads per block tried (those within the spec's limit)
SPLIT_FACTORS = (4, 2)  # row-split: the rule's chunks per row times and over these
ELEMENTS_PER_THREAD = (2, 4)  # element-wise: elements per thread tried besides the rule's one


def knobs(plan: StitchPlan) -> dict:
    """The configuration of a candidate, as recorded by `tvm-stitch tune`."""
    m = plan.mapping
    return {"rank": plan.rank, "threads": m.threads, "vector": m.vector, "rows_per_task": m.rows_per_task}


def candidates(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec, analysis: Analysis | None = None) -> list:
    """The rule plan first, then its valid variants, without duplicates.

    `analysis`: the planner's `analyse(func, spec.family)`, made here if not given.
    """
    if rule.target == "cpu":
        found = _cpu(func, rule, spec, analysis)
    else:
        analyses = Analyses()  # the re-plans below share block views and inlining trials
        found = _cuda(rule, spec)
        found = found[:1] + _elements_per_thread(rule) + found[1:]
        found += _scalar([rule] + found) + _recomputing(func, rule, spec, analyses) + _splits(func, rule, spec, analyses)
        found += _through_reshape(func, rule, spec) + column_tile_plans(func, rule, spec)
        found += last_block_plans([rule] + found)
    out, seen = [], set()
    for plan in [rule] + found:
        key = tuple(sorted(knobs(plan).items())) + (plan.mapping.split, plan.mapping.across, plan.mapping.last_block_rows,
                                                     tuple(plan.inlined()))
        if key not in seen:
            seen.add(key)
            out.append(plan)
    return out


def vector_choices(width_bits: int, dtype_bits: int) -> list:
    """1, half, full and double the target's lanes for a dtype (half precision computes in float32)."""
    lanes = max(1, width_bits // max(32, dtype_bits))
    return sorted({1, max(1, lanes // 2), lanes, 2 * lanes})


def _elements_per_task(func: tirx.PrimFunc, rank: int) -> int:
    """Elements of the largest parameter under `rank` row axes (those of one row task)."""
    sizes = [static_product(p.shape[rank:]) for p in buffer_params(func) if len(p.shape) >= rank]
    return max([1] + [n for n in sizes if n is not None])


def _by_rank(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec, analysis: Analysis | None) -> list:
    """The rule plan and the planner's plans for the other ranks within the aligned depth whose
    row tasks hold at least one vector (a task of single elements leaves nothing to vectorise and
    one branch per element where kernels share a launch)."""
    plans = [rule]
    for rank in range(1, rule.aligned_depth + 1):
        if rank == rule.rank or _elements_per_task(func, rank) < MIN_LANES:
            continue
        try:
            if analysis is None:
                analysis = analyse(func, spec.family)
            plans.append(plan_row_resident(func, spec, rule.kernel, rank=rank, analysis=analysis))
        except PlanError:
            continue  # e.g. no row axis left for a large kernel
    return plans


def _cpu(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec, analysis: Analysis | None) -> list:
    out_dtype = tvm.DataType(str(buffer_params(func)[-1].dtype))
    vectors = vector_choices(spec.vector_bytes * 8, out_dtype.bits)
    cores = spec.cores
    out = []
    for plan in _by_rank(func, rule, spec, analysis):
        rows = plan.mapping.rows
        threads = sorted({1, cores}) if rows != 1 else [1]
        # Rows across the lanes: the compiler picks the vector width, the plan's lanes only say which rows qualify.
        for t in threads:
            for v in [plan.mapping.vector] if plan.mapping.across else vectors:
                mapping = dataclasses.replace(plan.mapping, threads=t, vector=v)
                out.append(dataclasses.replace(plan, mapping=mapping))
    return out


def _cuda(rule: StitchPlan, spec: TargetSpec) -> list:
    """Row-resident plans: threads per block (for rows spread over threads) and rows per
    block, within the limits, with their register and occupancy estimates."""
    m = rule.mapping
    if m.rows <= 0 or rule.scheme != "row-resident":
        return []
    most = block_threads(spec)
    thread_choices = [1] if m.threads == 1 else [t for t in CUDA_THREADS if t <= most]
    out = []
    for threads in thread_choices:
        per = 1
        while threads * per <= most and per <= m.rows:
            shared = cuda_shared_bytes(rule.shared_rows, rule.shared_reductions, threads, per, spec.warp_size)
            fits = shared <= spec.shared_bytes_per_block
            # A barrier may not sit under a thread predicate: rows split evenly over blocks.
            even = threads == 1 or m.rows % per == 0
            # Rows moved first (strided slices per row) keep the rule's packing: packed otherwise, their
            # blocks' cross-thread reductions race under Oclgrind (BatchNorm over channels).
            kept = not rule.row_axes or per == m.rows_per_task
            if fits and even and kept:
                mapping = dataclasses.replace(m, threads=threads, rows_per_task=per, grid=-(-m.rows // per))
                out.append(with_resources(dataclasses.replace(rule, mapping=mapping, shared_bytes=shared)))
            per *= 2
    return out


def _elements_per_thread(rule: StitchPlan) -> list:
    """An element-wise row-resident plan (a thread per element) with ELEMENTS_PER_THREAD elements per
    thread instead, a block's width apart (`vector`; unrolled loads in flight), where they divide its blocks."""
    m = rule.mapping
    if (rule.scheme != "row-resident" or rule.row_axes or rule.bounds or m.threads != 1 or m.row_elements != 1
            or m.vector != 1 or m.rows <= 0):
        return []
    out = []
    for lanes in ELEMENTS_PER_THREAD:
        if m.rows % (m.rows_per_task * lanes) == 0:
            mapping = dataclasses.replace(m, vector=lanes, grid=m.rows // (m.rows_per_task * lanes))
            note = f"{lanes} elements per thread, a block's width apart (unrolled: {lanes} loads in flight)"
            out.append(with_resources(dataclasses.replace(rule, mapping=mapping, notes=rule.notes + (note,))))
    return out


def _scalar(plans: list) -> list:
    """The plans with vector accesses, with scalar ones instead."""
    return [dataclasses.replace(p, mapping=dataclasses.replace(p.mapping, vector=1)) for p in plans
            if p.mapping.vector > 1]


def _recomputing(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec, analyses: Analyses) -> list:
    """Row-resident plans (rows leading) with one more shared intermediate recomputed in its consumers."""
    if rule.scheme != "row-resident" or rule.row_axes or rule.bounds:
        return []
    demoted = tuple(i.name for i in rule.intermediates if i.inlined and i.why.startswith("demoted"))
    out = []
    for inter in rule.intermediates:
        if inter.level != SHARED or inter.inlined or inter.name in rule.outputs:
            continue
        try:
            recompute = demoted + (inter.name,)
            analysis = analyse(func, spec.family, recompute, analyses)
            plan = plan_row_resident(func, spec, rule.kernel, recompute=recompute, analysis=analysis)
        except PlanError:
            continue  # e.g. a reduction, which cannot be inlined
        out.append(with_resources(plan))
    return out


def _splits(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec, analyses: Analyses) -> list:
    """Row-split plans (rows leading, or through the rule's reshape) with more or fewer chunks per
    row than the rule's."""
    if rule.scheme != "row-split" or rule.row_axes:
        return []
    if rule.reshaped:
        func, analyses = rows_through_reshape(func, rule.reshaped), Analyses()
    split = rule.mapping.split
    counts = sorted({c for f in SPLIT_FACTORS for c in (split * f, split // f) if c >= 1 and c != split})
    out = []
    for count in counts:
        try:
            plan = plan_row_split(func, spec, rule.kernel, split=count, analyses=analyses)
        except PlanError:
            continue  # chunks that do not divide the row, or shorter than the least chunk
        if rule.reshaped:  # the rule's last note says which blocks are re-laid
            plan = dataclasses.replace(plan, reshaped=rule.reshaped, notes=plan.notes + rule.notes[-1:])
        out.append(with_resources(plan))
    return out


def _through_reshape(func: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec) -> list:
    """For a row-resident rule of fewer blocks than SMs: the row-split plans of its rows taken
    through the reshape that hides them (a GroupNorm's (batch, group)), where there are few long ones."""
    if rule.scheme != "row-resident" or rule.row_axes or not 0 < rule.mapping.grid < spec.sms:
        return []
    names = reshaping_blocks(func)
    if not names:
        return []
    try:
        split = plan_row_split(rows_through_reshape(func, names), spec, rule.kernel, few_long_rows_only=True)
    except (PlanError, RuntimeError, ValueError):  # TVM reports a map it cannot invert as either
        return []  # not a bijection of the block's iterators, or rows the split does not take
    note = (f"rows through a reshape: {', '.join(names)} iterate the tensor they reshape, "
            f"{split.mapping.rows} rows instead of {rule.mapping.rows}")
    plan = with_resources(dataclasses.replace(split, reshaped=names, notes=split.notes + (note,)))
    return [plan] + _splits(func, plan, spec, Analyses())
