"""Per-kernel resources on a CUDA GPU: a register estimate and the occupancy it allows.

Registers are estimated from the plan, not compiled: a base for indices,
pointers and the predicate, plus the values each thread keeps live: every
intermediate computed once (an accumulator, a broadcast value or a stored
element), the lanes of 128-bit accesses, and for a thread that walks a row
alone (column access) the unrolled serial loop; a column-split thread a
partial sum per reduction and lane. tests/test_resources.py checks the
estimate against ptxas on the suite kernels. The SM limits (threads, blocks,
registers, shared memory) come from the TargetSpec.

`register_budget` is what ptxas allots a thread of a kernel compiled with
`__launch_bounds__(threads)` (TVM writes the block's threads there) before
it spills: it keeps two such blocks resident per SM. Measured (nvcc 13,
sm_80 and sm_90) on column-split kernels of two float32 reductions with
128-bit loads (LayerNorm backward's dgamma and dbeta): blocks of 1024
threads get 32 registers and spill 4 bytes at 2048x768 (sm_90) and
4096x768 (sm_80), blocks of 512 threads take 40-48 and do not, but for
threads of 4 rows (1024x768, 1024x4096), whose loop nvcc unrolls whole,
loading every row at once.
"""

from __future__ import annotations

import dataclasses

from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec


BASE_REGISTERS = 16
PER_KEPT_VALUE = 2
PER_VECTOR_LANE = 2
MIX_ROW_COPIES = 2  # mix-order: the (rows, columns) inputs a thread keeps its columns of (x and dy)
THREAD_PER_ROW_REDUCTION = 48  # a serial, unrolled walk down a column
PER_ACCUMULATOR_LANE = 2  # column-split: a reduction's partial sum per lane and the lane loaded into it
RESIDENT_BLOCKS = 2  # blocks of its launch bound ptxas keeps resident per SM when it allots registers


WHOLLY_UNROLLED_ROWS = 4  # column-split: nvcc unrolls a thread's loop over this many rows or fewer whole


def column_split_registers(reductions: int, vector: int, loads: int = 0, rows_per_thread: int = 0) -> int:
    """Registers of a column-split thread: the base, its vector lanes, a partial sum per reduction and
    lane; where its loop over `rows_per_thread` rows is unrolled whole and it has several reductions,
    the `loads` (buffers read per row) of every row at once, `vector` lanes each, per reduction past the
    first (fitted to ptxas: one reduction's loads overlap its adds, see the module's note)."""
    registers = (BASE_REGISTERS + (PER_VECTOR_LANE * vector if vector > 1 else 0)
                 + PER_ACCUMULATOR_LANE * reductions * vector)
    if rows_per_thread <= WHOLLY_UNROLLED_ROWS:
        registers += (reductions - 1) * loads * vector * rows_per_thread
    return registers


def register_budget(threads_per_block: int, spec: TargetSpec) -> int:
    """Registers per thread ptxas allots a block of `threads_per_block` before it spills."""
    return spec.registers_per_sm // (RESIDENT_BLOCKS * max(1, threads_per_block))


PER_UNROLLED_VALUE = 2  # registers of a value an unrolled row loop loads in one step and keeps for later passes


def unrolled_steps(threads_per_block: int, loads_per_step: int, spec: TargetSpec) -> int:
    """The most steps of a thread's loop over a row worth unrolling without spills. Unrolled, nvcc
    loads each step's values of an input the row's passes re-read (a demoted row, recomputed from
    global memory) once and keeps them live across the passes: `loads_per_step` inputs, each a value
    per step, within the register budget of a block of `threads_per_block` less the base. Measured:
    a float16 LayerNorm + softmax row of 30000 over 1024 threads (30 steps, x re-read in 4 passes)
    spilled 32 bytes (sm_90) and 12 (sm_80) unrolled whole, none rolled."""
    room = register_budget(threads_per_block, spec) - BASE_REGISTERS
    return max(1, room // (PER_UNROLLED_VALUE * max(1, loads_per_step)))


def estimate_registers(plan: StitchPlan) -> int:
    kept = sum(1 for i in plan.intermediates if not i.inlined)
    if plan.scheme == "column-split":
        return column_split_registers(plan.reductions, plan.mapping.vector) + PER_KEPT_VALUE * kept
    if plan.scheme == "mix-order":  # per column step and lane: a partial per column reduction, x and dy
        steps = plan.mapping.row_elements // (plan.mapping.threads * plan.mapping.vector)
        lanes = plan.mapping.vector
        return BASE_REGISTERS + 2 * PER_VECTOR_LANE * lanes + steps * lanes * (len(plan.dominant) + MIX_ROW_COPIES)
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
