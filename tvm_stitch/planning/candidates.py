"""Valid configurations of a stitched group: variants of the rule-based plan.

The rules (planner.py) give one plan; the cost model chooses among the
variants listed here, over the knobs the schedules honour:
- CPU: cores (parallel over rows, or serial), vector lanes (1, half, full
  and double the target's width for the output dtype) and the row axes
  (every rank within the aligned depth whose row tasks hold a vector or
  more, each planned by the planner itself);
- CUDA: threads per block and rows per block, within the thread and shared
  memory limits (features only: no GPU model is trained yet).
Every variant keeps the rule plan's levels and outputs, so it computes the
same values; the first candidate is always the rule plan.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx

from schedules.cpu.row_resident import MIN_LANES

from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.planner import CUDA_MAX_THREADS, CUDA_SHARED_LIMIT, PlanError, plan_row_resident
from tvm_stitch.planning.resources import estimate_registers, occupancy
from tvm_stitch.threads import cpu_threads
from tvm_stitch.analysis.tir_view import buffer_params, static_product

CUDA_THREADS = (32, 64, 128, 256)


def knobs(plan: StitchPlan) -> dict:
    """The configuration of a candidate, as recorded by `tvm-stitch tune`."""
    m = plan.mapping
    return {"rank": plan.rank, "threads": m.threads, "vector": m.vector, "rows_per_task": m.rows_per_task}


def candidates(func: tirx.PrimFunc, rule: StitchPlan, target: tvm.target.Target) -> list:
    """The rule plan first, then its valid variants, without duplicates."""
    if rule.target == "cpu":
        found = _cpu(func, rule, target)
    else:
        found = _cuda(rule)
    out, seen = [], set()
    for plan in [rule] + found:
        key = tuple(sorted(knobs(plan).items()))
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


def _by_rank(func: tirx.PrimFunc, rule: StitchPlan, target: tvm.target.Target) -> list:
    """The rule plan and the planner's plans for the other ranks within the aligned depth whose
    row tasks hold at least one vector (a task of single elements leaves nothing to vectorise and
    one branch per element where kernels share a launch)."""
    plans = [rule]
    for rank in range(1, rule.aligned_depth + 1):
        if rank == rule.rank or _elements_per_task(func, rank) < MIN_LANES:
            continue
        try:
            plans.append(plan_row_resident(func, target, rule.kernel, rank=rank))
        except PlanError:
            continue  # e.g. no row axis left for a large kernel
    return plans


def _cpu(func: tirx.PrimFunc, rule: StitchPlan, target: tvm.target.Target) -> list:
    out_dtype = tvm.DataType(str(buffer_params(func)[-1].dtype))
    vectors = vector_choices(tvm.target.codegen.llvm_get_vector_width(target), out_dtype.bits)
    cores = cpu_threads()
    out = []
    for plan in _by_rank(func, rule, target):
        rows = plan.mapping.rows
        threads = sorted({1, cores}) if rows != 1 else [1]
        for t in threads:
            for v in vectors:
                mapping = dataclasses.replace(plan.mapping, threads=t, vector=v)
                out.append(dataclasses.replace(plan, mapping=mapping))
    return out


def _cuda(rule: StitchPlan) -> list:
    """Row-resident plans: threads per block (for rows spread over threads) and rows per
    block, within the limits, with their register and occupancy estimates."""
    m = rule.mapping
    if m.rows <= 0 or rule.scheme != "row-resident":
        return []
    shared_per_row = rule.shared_bytes // max(1, m.rows_per_task)
    thread_choices = [1] if m.threads == 1 else list(CUDA_THREADS)
    out = []
    for threads in thread_choices:
        per = 1
        while threads * per <= CUDA_MAX_THREADS and per <= m.rows:
            fits = shared_per_row * per <= CUDA_SHARED_LIMIT
            # A barrier may not sit under a thread predicate: rows split evenly over blocks.
            even = threads == 1 or m.rows % per == 0
            if fits and even:
                mapping = dataclasses.replace(m, threads=threads, rows_per_task=per, grid=-(-m.rows // per))
                plan = dataclasses.replace(rule, mapping=mapping, shared_bytes=shared_per_row * per)
                registers = estimate_registers(plan)
                out.append(dataclasses.replace(plan, registers=registers, occupancy=occupancy(
                    plan.threads_per_block, registers, plan.shared_bytes)))
            per *= 2
    return out
