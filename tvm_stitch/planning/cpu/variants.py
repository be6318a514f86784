"""The CPU size variant of a kernel whose row count is one symbolic size: the counts below the core count.

The CPU rules plan a static row count differently by size where few long
rows are cut into chunks over the cores (tasks.row_chunks): fewer than
CPU_TASKS_PER_CORE rows per core, rows of CPU_SPLIT_MIN_ROW elements or more
(the chunks per row halving as the rows double). The plan for every size
runs one task per row, so it leaves cores idle only at counts below the
core count; from there up every core has a row, and cutting rows adds
parallel loops (a (m, 65536) softmax on 2 cores at m = 2: 1.19x the plan for
every size's time with the rows cut in 8 chunks,
benchmarks/results/cpu-2core-models/2026-12-02-cpu-size-variants.md). The
counts below the cores at which the rules cut rows, within the size's
bounds, are one range, served by one variant: the plan made for the smallest
count (the most chunks, each of CPU_SPLIT_MIN_CHUNK elements or more). One
variant, not one per chunk count: each variant compiles in about the time of
the kernel for every size (its lowering and code generation), and the build
with variants stays within twice the one-plan build. Plain data only:
kernels/cpu_variants.py plans the counts and builds the dispatch.
"""

from __future__ import annotations

from tvm_stitch.planning.cpu.tasks import row_chunks
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.variants import SizeRange


def chunked_range(size: str, low: int | None, high: int | None, row_length: int | None, cores: int,
                  rows_per_count: int = 1) -> SizeRange | None:
    """The counts of `size` within the bounds `low` <= count <= `high` (None: no bound) that make fewer
    rows than `cores` and at which the rules cut rows of `row_length` elements (None: symbolic) into
    chunks over the cores, each count making `rows_per_count` rows (the other row axes): the smallest
    count up (no lower bound); None where there are none."""
    first = max(1, low or 1)
    if cores < 2 or row_length is None or row_chunks(first * rows_per_count, row_length, cores) == 1:
        return None
    last = (cores - 1) // rows_per_count  # fewer rows than cores (row_chunks cuts them all)
    if high is not None:
        last = min(last, high)
    return SizeRange(size, None, last) if last >= first else None


def chunked(plan: StitchPlan) -> bool:
    """Whether `plan` cuts each row into chunks over the cores."""
    return plan.target == "cpu" and plan.mapping.split > 1
