"""How many threads a CUDA launch needs to keep the GPU's memory busy, and the row-resident rule
that follows from it for few long rows.

Little's law: a GPU streams at its bandwidth only with about bandwidth x
latency bytes in flight (an H200: ~4.8 TB/s x ~0.7 us = ~3.4 MB), tens of
thousands of loads. A launch is counted as filling the GPU at a quarter of
its resident threads (`fill_threads`: sm_90, 132 SMs x 2048 / 4 = 67584).
"""

from __future__ import annotations

from tvm_stitch.planning.spec import TargetSpec

FILL_SHARE = 4  # a launch fills the GPU at a quarter of its resident threads (spec.sms * spec.sm_threads)
MIN_PER_THREAD = 4  # elements of a row each thread takes at least when threads are added for fill
LARGE_KERNEL = 1 << 20  # elements below which a kernel is too small for its thread count to matter


def fill_threads(spec: TargetSpec) -> int:
    """Threads a launch wants in flight to saturate memory on `spec`'s GPU."""
    return spec.sms * spec.sm_threads // FILL_SHARE


def filling_row_threads(rows: int | None, row_length: int | None, threads: int, spec: TargetSpec) -> int:
    """Threads per row task for a row-resident kernel of `rows` rows of `row_length` elements:
    `threads`, doubled (up to the target's threads per block, each thread keeping MIN_PER_THREAD
    elements of a row) while the launch has fewer than `fill_threads` (BatchNorm's statistics:
    64 channels of 100352 elements get 1024 threads each, not 256). Unchanged for symbolic sizes and
    kernels of fewer than LARGE_KERNEL elements."""
    if rows is None or row_length is None or rows * row_length < LARGE_KERNEL:
        return threads
    while (rows * threads < fill_threads(spec) and threads * 2 <= spec.max_threads_per_block
           and row_length >= threads * 2 * MIN_PER_THREAD):
        threads *= 2
    return threads


def few_wide_rows(rows: int | None, row_length: int | None, spec: TargetSpec) -> bool:
    """Whether a spatial-only kernel's rows are too few for a thread each to fill the GPU while its
    elements would (a gather within rows of a recomputed rotary embedding whose slices are outputs:
    4096 rows of 64 elements): its rows are then spread over threads like a reduction's."""
    return (rows is not None and row_length is not None and row_length > 1 and rows < fill_threads(spec)
            and rows * row_length >= fill_threads(spec))
