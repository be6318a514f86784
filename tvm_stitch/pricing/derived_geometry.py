"""Launch geometry of a CUDA plan derived from a lowered kernel of the same code, without scheduling it.

Two changes of a row-resident or row-split plan leave what each thread does
as it was and move only the launch:
- the row count (the same plan at another count): the grid is
  ceil(rows / rows per block) x chunks per row, for every kernel;
- the rows per block of a plan that packs rows into a block with barriers
  (2 or more rows per block, before and after, at the same row count): the
  grid as above, the threads and shared memory per block in proportion to
  the rows per block (each row's threads and staging side by side).
Both hold where the row count is at least the rows per block at both ends:
fewer rows than a block packs leave TVM a shorter packed loop, which it
simplifies differently. `derivable` says where a derivation applies;
tests/test_derived_geometry.py compares derived and lowered geometries over
softmax, LayerNorm and log-softmax rows of 32 to 30000 elements at row counts
from 1 to 2^20, for the rule plans, their candidates and the plans scheduled
for a symbolic count. Registers are the plan's estimate, as for a lowered
kernel (kernel_geometry.py); the device-memory bytes are the caller's.
"""

from __future__ import annotations

import dataclasses

from tvm_stitch.pricing.kernel_geometry import with_dram_bytes
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.time_model import DEFAULT_REGISTERS
from tvm_stitch.planning.variants import key, packs_with_barriers


def plan_grid(plan: StitchPlan, rows: int) -> int:
    """Blocks of each kernel of `plan` over `rows` rows."""
    return -(-rows // plan.mapping.rows_per_task) * plan.mapping.split


def derivable(lowered: StitchPlan, lowered_rows: int, plan: StitchPlan, rows: int) -> bool:
    """Whether the geometry of `plan` at `rows` rows derives from `lowered`'s at `lowered_rows`:
    the same code at another row count, or another packing of the same rows (see above)."""
    if plan.scheme not in ("row-resident", "row-split") or min(lowered_rows, rows) < 1:
        return False
    if rows < plan.mapping.rows_per_task or lowered_rows < lowered.mapping.rows_per_task:
        return False
    if key(lowered) == key(plan):
        return True
    return (rows == lowered_rows and packs_with_barriers(lowered) and packs_with_barriers(plan)
            and key(_one_row_per_block(lowered)) == key(_one_row_per_block(plan)))


def derived(geometries: list, lowered: StitchPlan, lowered_rows: int, plan: StitchPlan, rows: int,
            dram_bytes: int) -> list | None:
    """The KernelGeometry of each kernel of `plan` at `rows` rows, from `geometries` (of `lowered`
    at `lowered_rows`, `derivable`), `dram_bytes` shared among them as for a lowered PrimFunc; None
    where a kernel's launch is not the plan's (a grid other than plan_grid, a packed launch)."""
    before, after = lowered.mapping.rows_per_task, plan.mapping.rows_per_task
    out = []
    for geometry in geometries:
        if (geometry.members or geometry.grid != plan_grid(lowered, lowered_rows) or geometry.threads % before
                or geometry.shared_bytes % before):
            return None
        out.append(dataclasses.replace(
            geometry, grid=plan_grid(plan, rows), threads=geometry.threads // before * after,
            shared_bytes=geometry.shared_bytes // before * after,
            registers=plan.registers if plan.registers > 0 else DEFAULT_REGISTERS))
    return with_dram_bytes(out, dram_bytes)


def _one_row_per_block(plan: StitchPlan) -> StitchPlan:
    return dataclasses.replace(plan, mapping=dataclasses.replace(plan.mapping, rows_per_task=1))
