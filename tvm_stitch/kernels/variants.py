"""A kernel of symbolic row count compiled as a few variants, one chosen at run time by its size.

For a kernel whose row count is one symbolic size and whose plan has barriers
(several threads per row), planning/variants.py says which sizes another plan
serves (few long rows split over blocks, short rows packed into blocks). The
ranges are taken from the largest sizes down; each range's plan (the time
model's choice at the size it was made for) is priced against the plan valid
for every size (its compiled kernel at that size) and kept where it is faster
by more than TIE. Where the plan for every size is modeled there at the least
time any plan can have (one launch and one DRAM round trip), no plan is chosen
for the range; where the variant of the adjoining larger sizes is modeled there
within TIE of the range's rule plan, it serves the range too, without a timed
choice (that variant priced from its kernel for every size, scheduled once and reused by the
dispatch). The kept plans are scheduled on the same PrimFunc and joined under one dispatch on
the host: `if cond_1: variant_1 elif ...: else: the plan valid for every size`,
so the Relax program keeps one call and every launch is one variant's.

A variant packing rows into blocks with barriers needs whole blocks: it is
scheduled on views of the buffers whose row count is `(n // k) * k`, which its
condition (`n % k == 0`) makes the whole tensor; TVM then proves the packed
split exact and emits no predicate around the barriers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx

from tvm_stitch.analysis.size_bounds import at_sizes, size_bounds, sizes
from tvm_stitch.pricing.timed_choice import TIE
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import total_us
from tvm_stitch.planning.variants import (MAX_VARIANTS, SizeRange, Variant, key, merged, packs_with_barriers, ranges,
                                          sample_sizes, sampled_plans, symbolic)

# On the dispatching PrimFunc: [low, high, multiple, kernels] per variant in the dispatch's order (-1: no
# bound), the last for every size.
ATTR = "tvm_stitch.variants"


@dataclass(frozen=True)
class Planner:
    """What building variants needs from the pass: `rule(static fused)` -> the rule plan,
    `choose(static fused, rule plan)` -> the plan to build with its modeled_us, `price(static
    fused, plan)` -> the time model's KernelTime of each of its kernels, scheduled there (None: not
    priced), `priced(scheduled PrimFunc, plan, rows)` -> the same for a PrimFunc already scheduled
    for CUDA, static at `rows` rows, `schedule(func, plan)` -> the scheduled PrimFunc, `device`:
    whether the target binds threads (a dispatch on the host around kernels; its kernels are
    CUDA's, priced as scheduled);
    `made`: the variants' plans scheduled for every size (`_variant_func`), by `key`, each made
    once for the pricing of an adjoining range and the dispatch."""

    rule: object
    choose: object
    price: object
    priced: object
    schedule: object
    device: bool
    made: dict = field(default_factory=dict)


def row_size(fused: tirx.PrimFunc, plan: StitchPlan) -> tirx.Var | None:
    """The symbolic size that is the row count of a CUDA row-resident plan with barriers, when it is
    the kernel's only size and every parameter holds it as a whole extent of a row axis; else None."""
    if (plan.spec is None or plan.spec.family != "cuda" or plan.scheme != "row-resident" or plan.mapping.rows >= 0
            or plan.mapping.threads == 1 or plan.bounds or plan.row_axes):
        return None
    return whole_row_size(fused, plan.rank)


def whole_row_size(fused: tirx.PrimFunc, rank: int) -> tirx.Var | None:
    """The kernel's only symbolic size where every parameter holds it as a whole extent of one of its
    first `rank` (row) axes; else None."""
    found = list(sizes(fused).values())
    if len(found) != 1 or any(not isinstance(p.ty, tirx.BufferType) for p in fused.params):
        return None
    var = found[0]
    for param in fused.params:
        for index, dim in enumerate(param.ty.shape):
            held = any(v.same_as(var) for v in tirx.analysis.undefined_vars(dim))
            if held and (index >= rank or not dim.same_as(var)):
                return None
    return var


def size_variants(fused: tirx.PrimFunc, general: StitchPlan, general_func: tirx.PrimFunc, planner: Planner) -> tuple:
    """The variants worth compiling besides `general` (valid for every size, scheduled as
    `general_func`), in the dispatch's order, without their modeled traffic (`dispatching` adds it);
    () when one plan serves every size (the rules at the bounds agree with `general`: the sizes
    between are not planned)."""
    var = row_size(fused, general)
    if var is None:
        return ()
    low, high = size_bounds(fused).get(var.name, (None, None))
    statics = _Statics(fused, var.name, (low, high))
    samples, plans = _sampled(sample_sizes(low, high), statics, general, general_func, planner)
    if all(key(plan) == key(general) for plan in plans):
        return ()
    kept, above = [], None  # from the largest sizes down; `above`: the variant of the range just above
    for condition, sample, rule in reversed(ranges(var.name, samples, plans, general)):
        variant, gain = _range_variant(condition, sample, rule, above, statics, general, general_func, planner)
        if variant is not None and above is not None and variant.plan is above.plan:
            kept[-1] = (kept[-1][0], variant)  # the range above extended down over this one
        elif variant is not None:
            kept.append((gain, variant))
        above = variant
    best = sorted(kept, key=lambda pair: -pair[0])[:MAX_VARIANTS]
    chosen = [v for _, v in sorted(best, key=lambda pair: -kept.index(pair))]
    return merged(tuple(_raised(v, _ceiling(chosen, k, samples), statics, general, general_func, planner)
                        for k, v in enumerate(chosen)))


def _ceiling(chosen: list, index: int, samples: list) -> int | None:
    """The first size above the range of `chosen[index]` it may be raised to: the next sample (where
    the rules planned the plan for every size) or the next variant's lowest size, whichever is lower;
    None where the range has no top or the sizes just above it are another variant's."""
    high = chosen[index].condition.high
    above = [s for s in samples if s > high] if high is not None else []
    if not above:
        return None
    nearest = chosen[index + 1].condition.low if index + 1 < len(chosen) else None
    if nearest is not None and nearest <= high + 1:
        return None
    return min(above[0], nearest) if nearest is not None else above[0]


def _raised(variant: Variant, ceiling: int | None, statics, general: StitchPlan, general_func: tirx.PrimFunc,
            planner: Planner) -> Variant:
    """`variant` serving the sizes above its range, up to the largest of the range's top times 2, 4,
    ... below `ceiling` at which it is still modeled faster than the plan for every size by TIE (a
    sample's plan serves the sizes up to it, but the rules' plan changes somewhere between two
    samples: a row split that pays at 64 rows still pays at 128). Both are priced from kernels
    already scheduled (their geometry derived at each size, planning nothing again)."""
    condition = variant.condition
    if ceiling is None or not planner.device:
        return variant
    top, size = condition.high, condition.high * 2
    while size < ceiling and size % condition.multiple == 0:
        mine = _variant_times(variant, size, statics, general_func, planner)
        theirs = _general_times(statics, size, general, general_func, variant.plan, planner)
        if not mine or not theirs or total_us(mine) >= total_us(theirs) * (1 - TIE):
            break
        top, size = size, size * 2
    return replace(variant, condition=replace(condition, high=top)) if top != condition.high else variant


def _range_variant(condition: SizeRange, sample: int, rule: StitchPlan, above: Variant | None, statics,
                   general: StitchPlan, general_func: tirx.PrimFunc, planner: Planner) -> tuple:
    """(the variant serving the sizes of `condition`, its modeled gain over `general` at `sample`), or
    (None, 0): none beats `general` there by more than TIE. The variant `above` (of the adjoining larger
    sizes) serves them too where it is modeled within TIE of the range's rule plan at `sample` (no
    timed choice made); else the time model chooses among the rule plan's neighbours."""
    if (packs_with_barriers(rule) and rule.rank > 1) or not condition.holds_within(*statics.bounds):
        return None, 0.0  # rows of several axes flattened, then packed (a symbolic extent TVM cannot allocate for), or no size
    times = _general_times(statics, sample, general, general_func, rule, planner)
    everywhere = total_us(times) if times else -1.0
    if _at_least(times, rule.spec):
        return None, 0.0  # `general` is modeled at the least time any plan here can have: no choice beats it
    beats = lambda us: us >= 0 and (everywhere < 0 or us < everywhere * (1 - TIE))  # noqa: E731
    extended = _extended(above, condition, sample, rule, statics, general_func, planner)
    if extended is not None and beats(extended[1]):
        return extended[0], everywhere - extended[1] if everywhere >= 0 else float("inf")
    plan = planner.choose(statics.at(sample), rule)
    if not beats(plan.modeled_us):
        return None, 0.0
    return Variant(condition, plan, sample), everywhere - plan.modeled_us if everywhere >= 0 else float("inf")


def _sampled(samples: list, statics, general: StitchPlan, general_func: tirx.PrimFunc,
             planner: Planner) -> tuple:
    """(samples, the rule plan at each: sampled_plans) the ranges are read from. On CUDA, where the
    plan for every size is modeled at the least time any plan can have at each of the smallest
    samples, no range whose top is one of them is kept (`_range_variant`): the samples below the
    largest of them at which a run of plans ends are not planned (their plans would only bound ranges
    that are not kept); the plans at the others, and the ranges, are those of every sample."""
    made = {}

    def plan_at(size: int) -> StitchPlan:
        if size not in made:
            made[size] = planner.rule(statics.at(size))
        return made[size]

    least = 0  # the smallest samples at which `general` is modeled at the least time
    while planner.device and least < len(samples) - 1 and _at_least(
            _general_times(statics, samples[least], general, general_func, general, planner), general.spec):
        least += 1
    ends = (b for b in range(least - 1, 0, -1) if key(plan_at(samples[b])) != key(plan_at(samples[b + 1])))
    start = next(ends, 0)  # the largest of them at which a run of plans ends; 0: every sample
    return samples[start:], sampled_plans(samples[start:], plan_at)


def _at_least(times: list | None, spec: TargetSpec) -> bool:
    """Whether KernelTimes `times` are within TIE of the least time any plan of their kernel can have."""
    return bool(times) and least_us(times, spec) >= total_us(times) * (1 - TIE)


def _extended(above: Variant | None, condition: SizeRange, sample: int, rule: StitchPlan, statics,
              general_func: tirx.PrimFunc, planner: Planner) -> tuple | None:
    """(`above` serving `condition`'s sizes too, its modeled us at `sample`) where `above` adjoins
    `condition` (the same multiple) and is modeled there within TIE of `rule`; else None."""
    if (above is None or condition.high is None or above.condition.low != condition.high + 1
            or above.condition.multiple != condition.multiple):
        return None
    rule_times = planner.price(statics.at(sample), rule)
    above_times = _above_times(above, sample, rule, statics, general_func, planner) if rule_times else None
    if not rule_times or not above_times or total_us(above_times) > total_us(rule_times) * (1 + TIE):
        return None
    return replace(above, condition=replace(above.condition, low=condition.low)), total_us(above_times)


def _above_times(above: Variant, sample: int, rule: StitchPlan, statics, general_func: tirx.PrimFunc,
                 planner: Planner) -> list | None:
    """The time model's KernelTimes of `above`'s plan at `sample` rows: on CUDA, where `sample` is a
    whole number of its blocks, its kernel for every size (scheduled once, for the dispatch too) at
    that size; else its plan scheduled at that size."""
    if planner.device and sample % above.condition.multiple == 0:
        return _variant_times(above, sample, statics, general_func, planner)
    return planner.price(statics.at(sample), _restated(above.plan, rule))


def _variant_times(variant: Variant, size: int, statics, general_func: tirx.PrimFunc, planner: Planner) -> list | None:
    """The KernelTimes of `variant`'s kernel for every size (scheduled once, for the dispatch too) at
    `size` rows (a multiple of its condition's)."""
    func = _for_every_size(statics.fused, variant, general_func.params, planner)
    return planner.priced(at_sizes(func, {statics.size: size}), variant.plan, size)


def _for_every_size(fused: tirx.PrimFunc, variant: Variant, params: list, planner: Planner) -> tirx.PrimFunc:
    """`_variant_func` of `variant`, made once per plan (`planner.made`)."""
    made = key(variant.plan)
    if made not in planner.made:
        planner.made[made] = _variant_func(fused, variant, next(iter(sizes(fused).values())), params, planner)
    return planner.made[made]


def _restated(plan: StitchPlan, static: StitchPlan) -> StitchPlan:
    """`plan` (made for another row count) for the rows of `static`, a plan of a static count."""
    rows, m = static.mapping.rows, plan.mapping
    grid = -(-rows // m.rows_per_task) * m.split
    return replace(plan, mapping=replace(m, rows=rows, grid=grid), row_shape=static.row_shape)


class _Statics:
    """The fused PrimFunc at static row counts, each made once, when first asked for."""

    def __init__(self, fused: tirx.PrimFunc, size: str, bounds: tuple):
        self.fused, self.size, self.bounds, self.made = fused, size, bounds, {}

    def at(self, value: int) -> tirx.PrimFunc:
        if value not in self.made:
            self.made[value] = at_sizes(self.fused, {self.size: value})
        return self.made[value]


def _general_times(statics: _Statics, sample: int, general: StitchPlan, general_func: tirx.PrimFunc,
                   rule: StitchPlan, planner: Planner) -> list | None:
    """The time model's KernelTimes of the plan for every size at `sample` rows: on CUDA its
    compiled kernel at that size (nothing scheduled again); else scheduled at that size."""
    if planner.device:
        return planner.priced(at_sizes(general_func, {statics.size: sample}), general, sample)
    return planner.price(statics.at(sample), _at_count(general, rule))


def least_us(times: list, spec: TargetSpec) -> float:
    """The least modeled time of any plan of the kernel priced as `times`: one launch and, where a
    kernel loads from device memory (then every plan of the same function does), one DRAM round trip
    (time_model.py: each wave of a loading kernel takes at least one)."""
    loads = any(t.geometry is not None and any(count for _, count in t.geometry.loads) for t in times)
    return spec.launch_us + (spec.dram_latency_us if loads else 0.0)


def _at_count(plan: StitchPlan, static: StitchPlan) -> StitchPlan:
    """A one-row-per-block plan of a symbolic count, for the rows of a plan of a static count."""
    rows = static.mapping.rows
    return replace(plan, mapping=replace(plan.mapping, rows=rows, grid=rows), row_shape=static.row_shape)


def dispatching(fused: tirx.PrimFunc, general: tirx.PrimFunc, variants: tuple, planner: Planner) -> tuple:
    """(one PrimFunc running, per call, the first variant whose condition holds, else `general`;
    the variants with the modeled traffic of their kernels at the size each was planned for)."""
    var = whole_row_size(fused, StitchPlan.from_json(str(general.attrs["tvm_stitch.plan"])).rank)
    g_root = general.body.block
    body, allocs, priced = g_root.body, list(g_root.alloc_buffers), []
    for variant in reversed(variants):
        made = planner.made.pop(key(variant.plan), None)  # each scheduled variant used once: TIR defines a variable once
        func = made if made is not None else _variant_func(fused, variant, var, general.params, planner)
        priced.insert(0, _with_traffic(func, variant, var))
        cond = _condition(variant.condition, var)
        wrapped = tirx.call_intrin("bool", "tirx.tvm_thread_invariant", cond) if planner.device else cond
        body = tirx.IfThenElse(wrapped, func.body.block.body, body)
        allocs += list(func.body.block.alloc_buffers)
    root = s_tir.SBlock([], [], [], "root", body, alloc_buffers=allocs)
    func = tirx.PrimFunc(general.params, s_tir.SBlockRealize([], True, root), general.ret_type, general.attrs)
    recorded = [[_or_none(v.condition.low), _or_none(v.condition.high), v.condition.multiple, v.plan.kernels]
                for v in variants]
    return func.with_attr(ATTR, recorded + [[-1, -1, 1, 1]]), tuple(priced)


def _with_traffic(func: tirx.PrimFunc, variant: Variant, var: tirx.Var) -> Variant:
    """`variant` with the modeled traffic of its kernels (`func`, scheduled for every size) where
    the size is `variant.at`."""
    traffic = modeled_traffic(at_sizes(func, {var.name: variant.at}), variant.plan.spec)
    if traffic is None:
        return variant
    return replace(variant, plan=replace(variant.plan, modeled_bytes=traffic.total, ideal_bytes=traffic.ideal))


def _or_none(bound: int | None) -> int:
    return -1 if bound is None else bound


def _condition(condition: SizeRange, var: tirx.Var):
    const = lambda value: tirx.IntImm(str(var.ty), value)  # noqa: E731 - the size's integer type
    parts = []
    if condition.low is not None:
        parts.append(tirx.GE(var, const(condition.low)))
    if condition.high is not None:
        parts.append(tirx.LE(var, const(condition.high)))
    if condition.multiple > 1:
        parts.append(tirx.EQ(tirx.floormod(var, const(condition.multiple)), const(0)))
    out = parts[0] if parts else tirx.IntImm("bool", 1)
    for part in parts[1:]:
        out = tirx.And(out, part)
    return out


def _variant_func(fused: tirx.PrimFunc, variant: Variant, var: tirx.Var, params: list,
                  planner: Planner) -> tirx.PrimFunc:
    """The variant's plan scheduled on `fused` (on whole-block views where it packs rows with
    barriers), reading and writing `params` (the dispatching PrimFunc's), with fresh variables so
    that it sits next to the other variants in one body."""
    plan = symbolic(variant.plan, _row_shape(fused, var, variant.plan.rank))
    source = fused
    if packs_with_barriers(plan):
        k = tirx.IntImm(str(var.ty), plan.mapping.rows_per_task)
        whole = tirx.floordiv(var, k) * k
        views = {p: tirx.decl_buffer([whole if d.same_as(var) else d for d in p.ty.shape], p.ty.dtype, p.name)
                 for p in fused.params if any(d.same_as(var) for d in p.ty.shape)}
        source = fused.specialize(views)
    scheduled = planner.schedule(source, plan)
    # A view's rows are the first (n // k) * k of its tensor's, laid out alike: its accesses are the tensor's.
    return _renamed(scheduled, var, dict(zip(scheduled.params, params)))


def _row_shape(fused: tirx.PrimFunc, var: tirx.Var, rank: int) -> tuple:
    out = next(p for p in fused.params if any(d.same_as(var) for d in p.ty.shape))
    return tuple(str(d) for d in out.ty.shape[:rank])


def _renamed(func: tirx.PrimFunc, var: tirx.Var, params: dict) -> tirx.PrimFunc:
    """`func` with its parameters replaced as `params` says and a fresh copy of every variable it
    defines (loop, block and buffer variables): TIR defines each variable once per function."""
    fresh = dict(params)

    def renew(v, _mutator):
        if v.same_as(var):
            return v
        if v not in fresh:
            fresh[v] = tirx.Var(v.name, v.ty)
        return fresh[v]

    return tvm_ffi.structural_mutate(func, [(tirx.Var, renew)])


def launches_at(func: tirx.PrimFunc, value: int | None) -> int | None:
    """Kernels one call of a dispatching PrimFunc launches where its size is `value` (None: the
    variant for every size); None for a PrimFunc without variants."""
    recorded = func.attrs.get(ATTR) if func.attrs is not None else None
    if not recorded:
        return None
    for low, high, multiple, kernels in recorded:
        condition = SizeRange("", None if int(low) < 0 else int(low), None if int(high) < 0 else int(high),
                              int(multiple))
        if condition.holds(value) if value is not None else condition == SizeRange(""):
            return int(kernels)
    return None


def branch_at(func: tirx.PrimFunc, values: dict) -> tirx.PrimFunc:
    """The dispatching PrimFunc at static sizes `values`, reduced to the branch that runs there: a
    plain scheduled PrimFunc, as a static build's kernel (for checks of launches and traffic)."""
    static = at_sizes(func, values)
    analyzer = sym.Analyzer()
    body = static.body.block.body
    while isinstance(body, tirx.IfThenElse):
        cond = body.condition
        if isinstance(cond, tvm.ir.Call) and cond.op.same_as(tvm.ir.Op.get("tirx.tvm_thread_invariant")):
            cond = cond.args[0]
        taken = analyzer.simplify(cond)
        if not isinstance(taken, tirx.IntImm):
            raise ValueError(f"the dispatch condition {cond} is not decided at {values}")
        body = body.then_case if taken.value else body.else_case
    used = {v for v in tirx.analysis.undefined_vars(body)}
    root = static.body.block
    allocs = [b for b in root.alloc_buffers if b in used]
    new_root = s_tir.SBlock([], [], [], "root", body, alloc_buffers=allocs)
    return tirx.PrimFunc(static.params, s_tir.SBlockRealize([], True, new_root), static.ret_type,
                         static.attrs).without_attr(ATTR)

