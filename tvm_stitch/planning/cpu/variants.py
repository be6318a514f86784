"""The CPU size variant of a kernel whose row count is one symbolic size: the counts whose rows are cut into chunks.

The CPU rules plan a static row count differently by size where few long
rows are cut into chunks over the cores (tasks.row_chunks): fewer than
CPU_TASKS_PER_CORE rows per core, rows of CPU_SPLIT_MIN_ROW elements or more
(the chunks per row halving as the rows double). Those counts, within the
size's bounds, are one range, served by one variant: the plan made for the
smallest count (the most chunks, each of CPU_SPLIT_MIN_CHUNK elements or more,
so every larger count of the range gets at least the tasks its own static plan
has). One variant, not one per chunk count: each variant compiles in about
the time of the kernel for every size (its lowering and code generation), and
the build with variants stays within twice the one-plan build. Plain data
only: fusion/cpu_variants.py plans the counts and builds the dispatch.
"""

from __future__ import annotations

from tvm_stitch.planning.cpu.tasks import CPU_TASKS_PER_CORE, row_chunks
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.variants import SizeRange


def chunked_range(size: str, low: int | None, high: int | None, row_length: int | None, cores: int,
                  rows_per_count: int = 1) -> SizeRange | None:
    """The counts of `size` within the bounds `low` <= count <= `high` (None: no bound) at which the
    rules cut rows of `row_length` elements (None: symbolic) into chunks over `cores` cores, each count
    making `rows_per_count` rows (the other row axes): the smallest count up (no lower bound); None
    where they cut none."""
    first = max(1, low or 1)
    if cores < 2 or row_length is None or row_chunks(first * rows_per_count, row_length, cores) == 1:
        return None
    last = (cores * CPU_TASKS_PER_CORE - 1) // rows_per_count  # row_chunks cuts below this many tasks
    if high is not None:
        last = min(last, high)
    return SizeRange(size, None, last) if last >= first else None


def chunked(plan: StitchPlan) -> bool:
    """Whether `plan` cuts each row into chunks over the cores."""
    return plan.target == "cpu" and plan.mapping.split > 1
