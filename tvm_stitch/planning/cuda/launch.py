"""The launch shape of a CUDA row: threads per row, vector lanes per thread, rows per block."""

from __future__ import annotations

from tvm_stitch.planning.common import block_threads, wanted_blocks
from tvm_stitch.planning.spec import TargetSpec

CUDA_MIN_THREADS = 8  # below a quarter warp, packing more rows beats more threads per row


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def row_threads(row_length: int, spec: TargetSpec) -> int:
    """Threads for a row of `row_length` elements: the next power of two, within the block's threads."""
    return max(CUDA_MIN_THREADS, min(block_threads(spec), next_pow2(row_length)))


def widest_bytes(views: list) -> int:
    """Bytes of the widest element the blocks `views` access (at least one)."""
    return max(max(8, a.buffer.dtype.bits) for v in views for a in v.reads + v.writes) // 8


def vector_mapping(views: list, row_length: int, threads: int, spec: TargetSpec) -> tuple:
    """(vector lanes, threads) for the widest accesses: each thread takes `lanes` consecutive
    elements of a row, so a row of `row_length` needs a multiple of a warp of threads x lanes."""
    warp = spec.warp_size
    lanes = spec.vector_bytes // widest_bytes(views)
    while lanes > 1:
        per_row = row_length // lanes
        if row_length % lanes == 0 and per_row % warp == 0:
            count = min(block_threads(spec), per_row)
            while per_row % count:
                count -= warp
            return lanes, count
        lanes //= 2
    return 1, threads


def rows_per_block(rows: int | None, threads: int, shared_at, spatial_only: bool, spec: TargetSpec) -> int:
    """Rows packed into one thread block: up to `block_threads` threads, dividing the rows
    evenly (no thread predicate around a barrier), within shared memory (`shared_at(rows per
    block)`: bytes), leaving a block per SM."""
    per = 1
    most = block_threads(spec)
    if threads == 1:
        # One thread per row, no barriers, so a predicate may cover a partial last block
        # (also of a symbolic row count). Element-wise: full blocks. Serial per-row work
        # (columns): a warp of rows per block, so that few columns still make several blocks.
        cap = most if spatial_only else spec.warp_size
        while per < cap and (rows is None or per < rows):
            per *= 2
        return per
    if rows is None:
        return 1  # rows x threads with barriers: only whole blocks, which a symbolic count cannot promise
    while (
        threads * per * 2 <= most
        and rows % (per * 2) == 0
        and rows // (per * 2) >= wanted_blocks(spec) // 2
        and shared_at(per * 2) <= spec.shared_bytes_per_block
    ):
        per *= 2
    return per
