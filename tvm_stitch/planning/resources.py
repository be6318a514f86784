"""Per-kernel resources on an H100/H200-class GPU: a register estimate and the occupancy it allows.

Registers are estimated from the plan, not compiled: a base for indices,
pointers and the predicate, plus the values each thread keeps live: every
intermediate computed once (an accumulator, a broadcast value or a stored
element), the lanes of 128-bit accesses, and for a thread that walks a row
alone (column access) the unrolled serial loop. tests/test_resources.py
checks the estimate against ptxas on the suite kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm_stitch.planning.plan import StitchPlan


@dataclass(frozen=True)
class SM:
    """Limits of one streaming multiprocessor (sm_90: H100, H200)."""

    threads: int = 2048
    registers: int = 65536
    shared_bytes: int = 228 * 1024
    blocks: int = 32
    register_granule: int = 256  # registers are allocated per warp in units of this


H200_SM = SM()

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


WARP = 32
SHARED_ALIGN = 64  # bytes: TVM's CUDA code generator aligns every __shared__ array (alignas(64))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SHARED_ALIGN) * SHARED_ALIGN


def cuda_shared_bytes(shared_rows, reductions, threads: int, rows_per_block: int) -> int:
    """Static shared memory of a CUDA block, as ptxas counts it or more.

    `shared_rows`: bytes per row of each buffer the schedule puts in shared
    memory, allocated for the block's `rows_per_block` rows, each array
    padded to SHARED_ALIGN (ptxas may leave the last one unpadded).
    `reductions`: (value bytes, outputs per row) of each reduced value; one
    with fewer outputs per row than `threads` is reduced across the threads,
    and past one warp TVM's all-reduce (LowerThreadAllreduce) stages a value
    per warp and per row (red_buf_staging) and broadcasts the result per
    row (red_result), both in shared memory. Within a warp it shuffles.
    """
    total = sum(_aligned(nbytes * rows_per_block) for nbytes in shared_rows)
    if threads > WARP:
        warps = -(-threads // WARP)
        total += sum(_aligned(nbytes * warps * rows_per_block) + _aligned(nbytes * rows_per_block)
                     for nbytes, outputs in reductions if outputs < threads)
    return total


def occupancy(threads_per_block: int, registers: int, shared_bytes: int, sm: SM = H200_SM) -> float:
    """Resident warps over the SM's maximum, limited by threads, registers, shared memory and blocks."""
    warps = -(-threads_per_block // 32)
    per_warp = -(-registers * 32 // sm.register_granule) * sm.register_granule
    blocks = min(
        sm.blocks,
        sm.threads // (warps * 32),
        sm.registers // (per_warp * warps),
        sm.shared_bytes // shared_bytes if shared_bytes else sm.blocks,
    )
    return blocks * warps * 32 / sm.threads
