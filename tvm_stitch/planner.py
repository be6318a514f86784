"""Rules that turn a fused PrimFunc into a StitchPlan for a target.

The row-resident scheme: the leading aligned axes are rows; one row task
(a CUDA thread block, a CPU loop iteration) computes every block for its
row. Per block the planner chooses where its result lives:
- inlined into consumers (register level) when it is cheap element-wise or
  injective work and not a kernel output;
- on chip (shared memory on CUDA, a per-row buffer on CPU) when it is a
  reduction result, holds an expensive op (computed once, never
  recomputed), or is a kernel output that other blocks also read;
- kernel outputs are written to global memory.
Anything the scheme cannot express raises PlanError with the reason; the
caller then leaves the group to TVM's default path.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .plan import GLOBAL, REGISTER, SHARED, Intermediate, StitchPlan, ThreadMapping
from .row_alignment import analyze_rows
from .tir_view import block_views

CUDA_SHARED_LIMIT = 48 * 1024  # static shared memory per thread block
CUDA_MAX_THREADS = 256
CUDA_MIN_ROWS = 264  # two thread blocks per SM of an H100/H200 (132 SMs)
CPU_MIN_ROWS = 64  # row tasks for an even spread over cores
CPU_PARALLEL_MIN_WORK = 1 << 15  # elements below which a parallel launch costs more than it saves


# Without native half-precision arithmetic, every float16/bfloat16 op on the CPU
# converts through float32: recomputing it is not cheap.
EMULATED_ON_CPU = ("float16", "bfloat16")


class PlanError(Exception):
    """The group cannot be stitched by the available schemes; the message says why."""


def target_family(target: tvm.target.Target) -> str:
    kind = target.kind.name
    if kind == "cuda":
        return "cuda"
    if kind == "llvm":
        return "cpu"
    raise PlanError(f"no stitching schedules for target kind {kind!r}")


def _int(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _product(exprs) -> int | None:
    total = 1
    for e in exprs:
        value = _int(e)
        if value is None:
            return None
        total *= value
    return total


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def cpu_threads() -> int:
    import os

    env = os.environ.get("TVM_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1


def _level(view, consumers: list, levels: dict, evaluations: dict, is_output: bool,
           family: str) -> tuple:
    """Where a block's result lives, given the levels already chosen for its consumers.

    `evaluations[c]` is how often consumer c is evaluated per element of its
    own result when inlined; an expensive block is inlined only if that
    makes it evaluated once per element.
    """
    if is_output:
        if family == "cuda":
            return SHARED, "kernel output also read inside the kernel"
        return GLOBAL, "kernel output, read back by the same thread"
    if view.has_reduction:
        return SHARED, "reduction result broadcast over its row"
    if len(view.writes) != 1:
        return SHARED, "block writes several buffers"
    emulated = family == "cpu" and str(view.writes[0].buffer.dtype) in EMULATED_ON_CPU
    if not view.expensive and not emulated:
        return REGISTER, "cheap: recomputed in each consumer"
    if _evaluations(view, consumers, levels, evaluations) == 1:
        return REGISTER, f"{', '.join(view.expensive)} evaluated once, inlined into its consumer"
    if emulated:
        return SHARED, f"computed once: {view.writes[0].buffer.dtype} arithmetic is emulated on the CPU"
    return SHARED, f"computed once: {', '.join(view.expensive)}"


def _evaluations(view, consumers: list, levels: dict, evaluations: dict) -> int:
    buffer = view.writes[0].buffer
    return sum(
        c.loads_of(buffer) * (evaluations.get(c.name, 1) if levels.get(c.name, (GLOBAL,))[0] == REGISTER else 1)
        for c in consumers
    )


def _row_bytes(buffer, rank: int) -> int | None:
    per_row = _product(buffer.shape[rank:])
    return None if per_row is None else per_row * max(1, buffer.dtype.bits // 8)


def _input_readers(views: list, params: list, levels: dict, rank: int) -> dict:
    """Per input buffer read row-aligned: the kernel blocks that load it after inlining.

    A block kept at register level is inlined into its consumers, so its
    loads happen in them: they are attributed to every materialised block
    that (transitively) consumes it.
    """
    from .row_alignment import ALIGNED, access_kind

    inlined = {name for name, (level, _) in levels.items() if level == REGISTER}
    by_name = {v.name: v for v in views}
    params = [p for p in params if not any(w.buffer.same_as(p) for v in views for w in v.writes)]
    loads_of = {}
    for view in views:
        found = {}
        for read in view.reads:
            if any(read.buffer.same_as(p) for p in params):
                if len(read.buffer.shape) <= rank or access_kind(read, view.iter_vars[:rank]) != ALIGNED:
                    found[read.buffer.name] = None
                else:
                    found.setdefault(read.buffer.name, read.buffer)
        loads_of[view.name] = found

    def effective(name, seen=()):
        found = dict(loads_of[name])
        for read in by_name[name].reads:
            producer = next((v.name for v in views if v.name in inlined and v.name not in seen
                             and any(w.buffer.same_as(read.buffer) for w in v.writes)), None)
            if producer is not None:
                for key, buf in effective(producer, seen + (name,)).items():
                    found[key] = None if buf is None or found.get(key, buf) is None else buf
        return found

    readers: dict = {}
    unaligned = set()
    for view in views:
        if view.name in inlined:
            continue
        for key, buf in effective(view.name).items():
            if buf is None:
                unaligned.add(key)
            else:
                readers.setdefault(key, (buf, []))[1].append(view.name)
    return {buf: names for key, (buf, names) in readers.items() if key not in unaligned}


def _choose_rank(views: list, depth: int, family: str) -> int:
    """The fewest leading axes that still give enough row tasks (at most the aligned depth).

    Fewer row axes keep whole rows inside a task: contiguous inner loops to
    vectorise (CPU) or to spread over a block's threads (CUDA).
    """
    wanted = CUDA_MIN_ROWS if family == "cuda" else CPU_MIN_ROWS
    for rank in range(1, depth + 1):
        rows = _product(views[0].extents[:rank])
        if rows is None or rows >= wanted:
            return rank
    return depth


def plan_row_resident(func: tirx.PrimFunc, target: tvm.target.Target, name: str) -> StitchPlan:
    family = target_family(target)
    views = block_views(s_tir.Schedule(func))
    if not views:
        raise PlanError("no blocks")
    for view in views:
        if not view.trivial_binding:
            raise PlanError(f"block {view.name}: loop nest is not one loop per iterator")
        if not all(a.point for a in view.reads + view.writes):
            raise PlanError(f"block {view.name}: non-point buffer access")
    rank = _choose_rank(views, analyze_rows(func, views).depth, family)
    row_extents = views[0].extents[:rank]
    rows = _product(row_extents)

    params = list(func.params)
    outputs = {view.name for view in views if any(w.buffer.same_as(p) for w in view.writes for p in params)}
    consumers = {view.name: set() for view in views}
    for view in views:
        for read in view.reads:
            for producer in views:
                if producer.name != view.name and any(w.buffer.same_as(read.buffer) for w in producer.writes):
                    consumers[producer.name].add(view.name)

    by_name = {view.name: view for view in views}
    levels, evaluations = {}, {}
    for view in reversed(views):
        if not consumers[view.name]:
            continue
        users = [by_name[c] for c in consumers[view.name]]
        levels[view.name] = _level(view, users, levels, evaluations, view.name in outputs, family)
        if levels[view.name][0] == REGISTER:
            evaluations[view.name] = max(1, _evaluations(view, users, levels, evaluations))
    intermediates = []
    shared = 0
    within_max = 1
    for view in views:
        within = _product(view.extents[rank:])
        if within is None:
            raise PlanError(f"block {view.name}: symbolic extent inside a row")
        within_max = max(within_max, within)
        if view.name not in levels:
            continue
        level, why = levels[view.name]
        per_row = _product(e for e, r in zip(view.extents[rank:], view.is_reduce[rank:]) if not r)
        nbytes = per_row * max(1, view.writes[0].buffer.dtype.bits // 8)
        if level == SHARED:
            shared += nbytes
        intermediates.append(Intermediate(view.name, level, nbytes, why))

    cached_inputs = []
    if family == "cuda":
        for buffer, readers in _input_readers(views, params, levels, rank).items():
            row_bytes = _row_bytes(buffer, rank)
            if len(readers) >= 2 and row_bytes is not None and shared + row_bytes <= CUDA_SHARED_LIMIT:
                cached_inputs.append(buffer.name)
                shared += row_bytes

    if family == "cuda" and shared > CUDA_SHARED_LIMIT:
        raise PlanError(f"{shared} bytes of per-row intermediates exceed {CUDA_SHARED_LIMIT} of shared memory")

    if family == "cuda":
        threads = max(32, min(CUDA_MAX_THREADS, _next_pow2(within_max)))
        vector = 1
        grid = rows if rows is not None else -1
    else:
        work = max(_product(v.extents) or CPU_PARALLEL_MIN_WORK for v in views)
        threads = cpu_threads() if work >= CPU_PARALLEL_MIN_WORK else 1
        out_dtype = views[-1].writes[0].buffer.dtype
        lanes = tvm.target.codegen.llvm_get_vector_width(target) // max(8, out_dtype.bits)
        # Emulated half precision gains nothing from wide vectors: each lane converts alone.
        vector = 1 if str(out_dtype) in EMULATED_ON_CPU else max(1, lanes)
        grid = rows if rows is not None else -1

    dominant = tuple(v.name for v in views if v.has_reduction) or tuple(
        v.name for v in views if v.expensive
    ) or (views[-1].name,)
    notes = []
    if rank == 0:
        notes.append("no shared row axis: the whole kernel is one row task")
    return StitchPlan(
        kernel=name,
        target=family,
        scheme="row-resident",
        ops=tuple(v.name for v in views),
        dominant=dominant,
        rank=rank,
        row_shape=tuple(str(_int(e) if _int(e) is not None else e) for e in row_extents),
        mapping=ThreadMapping(rows if rows is not None else -1, 1, threads, vector, grid),
        intermediates=tuple(intermediates),
        outputs=tuple(v.name for v in views if v.name in outputs),
        cached_inputs=tuple(cached_inputs),
        shared_bytes=shared if family == "cuda" else 0,
        notes=tuple(notes),
    )
