"""What a group may become on the target: the partition's limits.

Made from the TargetSpec and the planners' thresholds, so that the
partition (grouping/partition.py) never joins what the planners cannot
stitch: a row's intermediates within what a row task keeps on chip, and
unions of few long rows (rows the planners split) exempt from that limit;
and a group's reductions and ops within what compiles in bounded time.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm_stitch.planning.cpu.tasks import CPU_SPLIT_MIN_ROW, CPU_TASKS_PER_CORE
from tvm_stitch.planning.row_split import SPLIT_MIN_ROW
from tvm_stitch.planning.spec import TargetSpec

CPU_ROW_BYTES = 1 << 20  # per-row intermediates a CPU row task keeps (in L2)
CPU_PARTITION_ROWS = 16  # row tasks that keep the cores busy, for the partition's parallelism rule
# A kernel's compile time grows faster than its stages (each schedule step and lowering walks the whole
# kernel, and a kernel's candidate plans grow with its intermediates): a group holds at most this many
# reductions and ops, so a long chain (K LayerNorms) becomes kernels of a few blocks each, identical ones
# planned and priced once, and compiles in time linear in its length.
GROUP_REDUCTIONS = 8
GROUP_OPS = 64


@dataclass(frozen=True)
class PartitionLimits:
    """What a group may become (see grouping/partition.py); made for a target by `partition_limits`."""

    row_bytes_limit: int  # per-row intermediates kept on chip (CUDA: a block's shared memory)
    parallel_rows: int = 128  # row tasks that fill the machine (about one wave on a GPU)
    small_work: int = 1 << 16  # elements below which parallelism does not matter
    long_rows_below: int = 0  # unions with fewer row tasks, of rows of at least
    long_row: int = 1 << 62  # this many elements, are split over blocks: no limit on row bytes or rows
    recompute_input_elements: int = 256  # a producer reading tensors of at most this many elements (from
    # cache, per use) is recomputed by the groups reading it instead of being a launch of its own
    max_reductions: int = GROUP_REDUCTIONS  # reductions of a group at most (compile time)
    max_ops: int = GROUP_OPS  # ops of a group at most (compile time)


def partition_limits(spec: TargetSpec, split_long_rows: bool = True) -> PartitionLimits:
    """The partition's limits for the target: what a row may keep on chip, and which unions of
    few long rows the planners split (`split_long_rows=False`: none, every row stays on chip)."""
    if spec.family == "cuda":
        # Few long rows are split over blocks (row-split): nothing per row stays on chip.
        return PartitionLimits(row_bytes_limit=spec.shared_bytes_per_block,
                               long_rows_below=spec.sms if split_long_rows else 0, long_row=SPLIT_MIN_ROW)
    # On the CPU a row's intermediates live in L1/L2, not a scratchpad; too few long rows
    # for the cores are cut into chunks (planning/cpu/tasks.py: row_chunks), nothing kept per row.
    return PartitionLimits(row_bytes_limit=CPU_ROW_BYTES, parallel_rows=CPU_PARTITION_ROWS,
                           long_rows_below=spec.cores * CPU_TASKS_PER_CORE if split_long_rows else 0,
                           long_row=CPU_SPLIT_MIN_ROW)
