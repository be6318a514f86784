"""Per-kernel resources on a CUDA GPU: a register estimate and the occupancy it allows.

Registers are estimated from the plan, not compiled: a base for indices,
pointers and the predicate, plus the values each thread keeps live: every
intermediate computed once (an accumulator, a broadcast value or a stored
element), the lanes of 128-bit accesses, and for a thread that walks a row
alone (column access) the unrolled serial loop. tests/test_resources.py
checks the estimate against ptxas on the suite kernels. The SM limits
(threads, blocks, registers, shared memory) come from the TargetSpec.
"""

from __future__ import annotations

import dataclasses

from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec


BASE_REGISTERS = 16
PER_KEPT_VALUE = 2
PER_VECTOR_LANE = 2
THREAD_PER_ROW_REDUCTION = 48  # a serial, unrolled walk down a column


def estimate_registers(plan: StitchPlan) -> int:
    kept = sum(1 for i in plan.intermediates if not i.inlined)
    registers = BASE_REGISTERS + PER_KEPT_VALUE * kept
    if plan.mapping.vector > 1:
        registers += PER_VECTOR_LANE * plan.mapping.vector
    if plan.mapping.threads == 1 and plan.reductions:
        registers += THREAD_PER_ROW_REDUCTION
    return registers


SHARED_ALIGN = 64  # bytes: TVM's CUDA code generator aligns every __shared__ array (alignas(64))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SHARED_ALIGN) * SHARED_ALIGN


def cuda_shared_bytes(shared_rows, reductions, threads: int, rows_per_block: int, warp: int) -> int:
    """Static shared memory of a CUDA block, as ptxas counts it or more.

    `shared_rows`: bytes per row of each buffer the schedule puts in shared
    memory, allocated for the block's `rows_per_block` rows, each array
    padded to SHARED_ALIGN (ptxas may leave the last one unpadded).
    `reductions`: (value bytes, outputs per row) of each reduced value; one
    with fewer outputs per row than `threads` is reduced across the threads,
    and past one warp (`warp` threads) TVM's all-reduce (LowerThreadAllreduce)
    stages a value per warp and per row (red_buf_staging) and broadcasts the
    result per row (red_result), both in shared memory. Within a warp it shuffles.
    """
    total = sum(_aligned(nbytes * rows_per_block) for nbytes in shared_rows)
    if threads > warp:
        warps = -(-threads // warp)
        total += sum(_aligned(nbytes * warps * rows_per_block) + _aligned(nbytes * rows_per_block)
                     for nbytes, outputs in reductions if outputs < threads)
    return total


def occupancy(threads_per_block: int, registers: int, shared_bytes: int, spec: TargetSpec) -> float:
    """Resident warps over the SM's maximum, limited by threads, registers, shared memory and blocks."""
    warp = spec.warp_size
    warps = -(-threads_per_block // warp)
    per_warp = -(-registers * warp // spec.register_granule) * spec.register_granule
    blocks = min(
        spec.sm_blocks,
        spec.sm_threads // (warps * warp),
        spec.registers_per_sm // (per_warp * warps),
        spec.sm_shared_bytes // shared_bytes if shared_bytes else spec.sm_blocks,
    )
    return blocks * warps * warp / spec.sm_threads


def with_resources(plan: StitchPlan) -> StitchPlan:
    """The plan with its register estimate and the occupancy that allows on the plan's spec."""
    registers = estimate_registers(plan)
    return dataclasses.replace(plan, registers=registers, occupancy=occupancy(
        plan.threads_per_block, registers, plan.shared_bytes, plan.spec))
