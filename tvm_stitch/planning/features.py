"""Features of a candidate configuration, the input of the cost model.

Deterministic numbers read from the fused PrimFunc (what the group
computes: shape, dtype, reductions, expensive ops, arithmetic, bytes) and
from the candidate plan (how it maps: rows, row length, cores, lanes,
whether the lanes divide the loops they split, CUDA threads, blocks and
waves over the SMs of the plan's spec). Sizes enter as log2, so that
shapes never seen in training fall between ones that were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.analysis.tir_view import buffer_params, static_product, view_of_block

FEATURES = (
    # the group
    "dtype_bits", "log_elements", "log_bytes", "inputs", "outputs", "blocks", "reductions",
    "inner_reductions", "expensive", "ops_per_element", "inlined", "on_chip", "log_reduce_len",
    # the candidate
    "rank", "log_rows", "log_row_len", "threads", "log_rows_per_thread", "vector", "log_lanes_per_row",
    "spatial_fit", "reduce_fit", "rows_per_task", "shared_kb", "waves", "rule",
)


@dataclass(frozen=True)
class GroupFacts:
    """What the fused PrimFunc computes, read once per group."""

    dtype_bits: int
    elements: int  # the largest block's iteration count
    nbytes: int  # bytes of all parameters (inputs and outputs)
    inputs: int
    outputs: int
    blocks: tuple  # (name, spatial extent, reduction extent, reduces inside a row at rank 1)
    expensive: int
    ops: int  # arithmetic operations per element, summed over the blocks


def _log2(value: float) -> float:
    return math.log2(max(1.0, float(value)))


def _operations(stmt) -> int:
    count = [0]

    def one(_node):
        count[0] += 1

    kinds = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Max, tirx.Min,
             tirx.Select, tirx.Cast, tvm.ir.Call)
    tvm_ffi.structural_walk(stmt, (kinds, one), order="post")
    return count[0]


def group_facts(func: tirx.PrimFunc) -> GroupFacts:
    blocks_found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: blocks_found.append(b)
                                        if b.name_hint != "root" else None), order="pre")
    views = [view_of_block(b) for b in blocks_found]
    written = {w.buffer.name for v in views for w in v.writes}
    params = buffer_params(func)
    nbytes = sum((static_product(b.shape) or 1) * max(1, b.dtype.bits // 8) for b in params)
    blocks = []
    for view in views:
        spatial = static_product(e for e, r in zip(view.extents, view.is_reduce) if not r) or 1
        reduce = static_product(e for e, r in zip(view.extents, view.is_reduce) if r) or 1
        inner = bool(view.is_reduce) and not view.is_reduce[0]
        blocks.append((view.name, spatial, reduce if view.has_reduction else 0, inner))
    ops = sum(_operations(b.body) for b in blocks_found)
    return GroupFacts(
        dtype_bits=max(b.dtype.bits for b in params) if params else 32,
        elements=max(s * max(1, r) for _, s, r, _ in blocks),
        nbytes=nbytes,
        inputs=sum(1 for b in params if b.name not in written),
        outputs=sum(1 for b in params if b.name in written),
        blocks=tuple(blocks),
        expensive=sum(len(v.expensive) for v in views),
        ops=ops,
    )


def features(facts: GroupFacts, plan: StitchPlan, rule: StitchPlan) -> list:
    """The feature vector of one candidate, in the order of FEATURES."""
    m = plan.mapping
    rows = m.rows if m.rows > 0 else 1
    row_len = facts.elements / rows
    inlined = set(plan.inlined())
    scheduled = [b for b in facts.blocks if b[0] not in inlined]
    reductions = [b for b in scheduled if b[2]]
    spatial = [b for b in scheduled if not b[2]]
    v = m.vector
    spatial_fit = sum(1 for _, s, _, _ in spatial if (s // rows) % v == 0) / max(1, len(spatial))
    reduce_fit = sum(1 for _, _, r, _ in reductions if r % v == 0 and r >= 2 * v) / max(1, len(reductions))
    blocks_launched = m.grid if m.grid > 0 else rows
    return [
        facts.dtype_bits,
        _log2(facts.elements),
        _log2(facts.nbytes),
        facts.inputs,
        facts.outputs,
        len(facts.blocks),
        len(reductions),
        sum(1 for b in reductions if b[3]),
        facts.expensive,
        facts.ops,
        len(inlined),
        sum(1 for i in plan.intermediates if i.level == "shared"),
        _log2(max((r for _, _, r, _ in reductions), default=1)),
        plan.rank,
        _log2(rows),
        _log2(row_len),
        m.threads,
        _log2(rows / max(1, m.threads if plan.target == "cpu" else 1)),
        v,
        _log2(row_len / v),
        spatial_fit,
        reduce_fit,
        m.rows_per_task,
        plan.shared_bytes / 1024,
        blocks_launched / plan.spec.sms if plan.target == "cuda" else 0.0,
        1 if (plan.rank, m.threads, m.vector, m.rows_per_task) == (
            rule.rank, rule.mapping.threads, rule.mapping.vector, rule.mapping.rows_per_task) else 0,
    ]
