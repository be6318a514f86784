"""How CPU row tasks spread over the cores: adjacent rows streamed together, long rows cut into chunks."""

from __future__ import annotations

CPU_STREAM_MIN_ROWS = 16  # adjacent rows streamed together when rows are columns: a 64-byte line of float32
CPU_STREAM_MAX_ROWS = 256  # at most 1 KB of float32 per step: a few cache lines, prefetched
CPU_TASKS_PER_CORE = 4  # streamed tasks per core, for an even spread
CPU_SPLIT_CHUNK = 4096  # longest reduction a streamed task sums in one go (accuracy; the rest: partials)
CPU_SPLIT_MIN_ROW = 1 << 15  # rows at least this long are cut into chunks when there are too few for the cores
CPU_SPLIT_MIN_CHUNK = 4096  # elements per chunk at least: a chunk's parallel task outweighs its launch share


def row_chunks(rows: int, row_length: int, threads: int) -> int:
    """Chunks per row for few long rows on the CPU (1: rows alone spread over the cores).

    With fewer rows than CPU_TASKS_PER_CORE per core and rows of at least
    CPU_SPLIT_MIN_ROW elements: the smallest power of two that gives every core
    CPU_TASKS_PER_CORE chunks, dividing the row, chunks of CPU_SPLIT_MIN_CHUNK
    elements or more.
    """
    if rows >= threads * CPU_TASKS_PER_CORE or row_length < CPU_SPLIT_MIN_ROW:
        return 1
    split = 1
    while (rows * split < threads * CPU_TASKS_PER_CORE and row_length % (split * 2) == 0
           and row_length // (split * 2) >= CPU_SPLIT_MIN_CHUNK):
        split *= 2
    return split


def stream_rows(rows: int | None, threads: int) -> int:
    """Adjacent rows per CPU task when rows are columns of the inputs (1: no streaming).

    A power of two from CPU_STREAM_MIN_ROWS up to CPU_STREAM_MAX_ROWS that
    divides the rows (no partial task, so the row loop vectorises) and leaves
    CPU_TASKS_PER_CORE tasks per core where the rows allow.
    """
    if rows is None or rows % CPU_STREAM_MIN_ROWS:
        return 1
    per = CPU_STREAM_MIN_ROWS
    while (per * 2 <= CPU_STREAM_MAX_ROWS and rows % (per * 2) == 0
           and rows // (per * 2) >= threads * CPU_TASKS_PER_CORE):
        per *= 2
    return per


def reduction_chunks(reduced: int) -> int:
    """Chunks a streamed task's reduction of `reduced` elements is cut into (partials, then combined)."""
    return -(-reduced // CPU_SPLIT_CHUNK)
