"""The column tiles a mix-order launch's combining blocks share (schedules/cuda/combine_in_launch.py):
threads across a tile, its columns, how many tiles; plan facts the planner prices and the schedule
realises."""

from __future__ import annotations

import tvm

from tvm_stitch.planning.cuda.arrival_limits import max_combining_blocks
from tvm_stitch.planning.plan import StitchPlan

PARTIAL_DTYPE = "float32"


def partial_vector(spec) -> int:
    """float32 partials a combining thread loads at once (one vector access)."""
    return max(1, spec.vector_bytes // (tvm.DataType(PARTIAL_DTYPE).bits // 8))


TILE_THREADS = (8, 4, 2)  # threads across a combine tile's columns: whole 32-byte sectors (2 x 16 bytes)


def _most_blocks(tiles: int, plan: StitchPlan) -> int:
    """The most combining blocks that share `tiles` evenly (at most max_combining_blocks)."""
    most = min(tiles, max_combining_blocks(plan.spec), plan.mapping.grid)
    return max(k for k in range(1, most + 1) if tiles % k == 0)


def tile_threads(plan: StitchPlan) -> int:
    """Threads across one combine tile's columns: of TILE_THREADS that divide the block's threads and
    the columns in whole vectors, the widest of those whose tiles the most blocks share; 0 for none."""
    vector = partial_vector(plan.spec)
    fits = [t for t in TILE_THREADS if plan.mapping.threads % t == 0 and plan.mapping.row_elements % (t * vector) == 0]
    if not fits:
        return 0
    return max(fits, key=lambda t: (_most_blocks(plan.mapping.row_elements // (t * vector), plan), t))


def tile_columns(plan: StitchPlan) -> int:
    """Columns of one combine tile (0: no tile fits)."""
    return tile_threads(plan) * partial_vector(plan.spec)


def combine_tiles(plan: StitchPlan) -> int:
    """Column tiles the combining blocks share (0: no tile fits)."""
    columns = tile_columns(plan)
    return plan.mapping.row_elements // columns if columns else 0
