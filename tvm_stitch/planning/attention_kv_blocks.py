"""Plans of the tensor-core attention kernel whose key range is split across blocks of one launch.

Where a chain has few (batch, head, query tile)s (a cross-attention of 128
queries: 12 heads x 8 tiles of 16 rows for 132 SMs), each tile's key range
is cut into `kv_blocks` chunks of whole key tiles, a block each
(flash-decoding, in one launch): a block runs the online softmax over its
chunk and writes its unnormalised output tile and each row's max `m` and
sum `l` (float32) to a workspace; it then takes a ticket of its tile's
arrival counter (schedules/cuda/arrivals.py), and the block that takes the
last one combines the tile's chunks (`O = sum_c o_c exp(m_c - M) / sum_c
l_c exp(m_c - M)`, `M = max_c m_c`), writes O and resets the counter. One
counter per tile: plans with more tiles than the counters (`SLOTS`) are not
offered, nor those of symbolic lengths (no bound known to hold), nor causal
ones (chunks past the diagonal would idle), nor splits that leave a chunk
without a key tile.

The time model prices the launch as two parts one after the other
(planning/time_model.py, a packed launch's members): the chunk blocks,
priced as the unsplit kernel's geometry over their share of the key tiles,
storing their partials and taking a ticket (a fence and an atomic: one
more round trip to memory); then the combine of each tile by one block,
a thread per row and share of its columns passing once over the chunks:
per chunk the row's max and sum (one 8-byte load) and its output columns
(16-byte loads where its columns allow), two exps. The workspace is written once and read once.
"""

from __future__ import annotations

import dataclasses
import math

from tvm_stitch.planning.cuda.arrival_limits import SLOTS
from tvm_stitch.planning import attention_mma
from tvm_stitch.planning.time_model import KernelGeometry

KV_BLOCKS = (2, 4, 8, 16, 32)  # chunks a query tile's key range may be cut into
COMBINE_OPS_PER_CHUNK = 5  # per chunk of a combining thread's row: the max, two exp arguments, the sum


def tiles(plan) -> int:
    """(batch, head, query tile)s of a plan: the arrival counters it uses."""
    return plan.shape.batch * plan.shape.heads * plan.q_tiles


def chunk_tiles(plan) -> int:
    """Key tiles of one chunk (the last chunk may have fewer)."""
    return -(-plan.k_tiles // plan.kv_blocks)


def offered(plan, kv_blocks: int) -> bool:
    """Whether `plan` (a tensor-core plan of one block per tile) may be split into `kv_blocks` chunks."""
    s = plan.shape
    if s.priced_at or s.mask == "causal" or not plan.mma or tiles(plan) > SLOTS:
        return False
    per_chunk = -(-plan.k_tiles // kv_blocks)
    return kv_blocks <= plan.k_tiles and (kv_blocks - 1) * per_chunk < plan.k_tiles


def candidates(plans) -> list:
    """The key-range splits of each tensor-core plan of `plans` that are offered."""
    return [dataclasses.replace(plan, kv_blocks=n) for plan in plans for n in KV_BLOCKS if offered(plan, n)]


def combine_columns(plan) -> int:
    """Columns of one row a combining thread takes: the block's threads share the tile's rows evenly."""
    return plan.shape.head_dim // (plan.threads // plan.q_tile)


def combine_vector(plan) -> int:
    """float32 output elements a combining thread loads at once (16 bytes where its columns allow)."""
    return math.gcd(4, combine_columns(plan))


def workspace_elements(plan) -> dict:
    """float32 elements of the workspace buffers: each chunk's output tile, and its rows' (max, sum)."""
    chunks = tiles(plan) * plan.kv_blocks
    return {"partial_o": chunks * plan.q_tile * plan.shape.head_dim, "partial_ml": chunks * plan.q_tile * 2}


def workspace_bytes(plan) -> int:
    return 4 * sum(workspace_elements(plan).values())


def geometry(plan, dram_bytes: int, name: str = "fused_attention") -> KernelGeometry:
    """The launch as the time model reads it: the chunk blocks, then one combining block per tile;
    `dram_bytes`: its modeled traffic (attention_cost.traffic, the workspace's included)."""
    unsplit = dataclasses.replace(plan, kv_blocks=1)
    chunk = attention_mma.geometry(unsplit, 0, chunk_tiles(plan) / plan.k_tiles, name)
    outputs = attention_mma.TILE * plan.shape.head_dim // plan.spec.warp_size
    chunk = dataclasses.replace(
        chunk, grid=plan.tasks, stores=((4, outputs + 2),), load_phases=chunk.load_phases + 1,
        barriers=chunk.barriers + 2)
    cols, vector, kb = combine_columns(plan), combine_vector(plan), plan.kv_blocks
    loads = ((8, kb), (4 * vector, kb * cols // vector))  # per chunk: the row's max and sum, its columns
    combine = KernelGeometry(
        name=f"{name}_combine", grid=tiles(plan), threads=plan.threads, loads=loads, stores=((2, cols),),
        load_sites=sum(count for _, count in loads), load_phases=1, serial_iterations=kb, sfu_ops=2 * kb + 1,
        registers=chunk.registers, shared_bytes=chunk.shared_bytes,
        flops=(("fp32", COMBINE_OPS_PER_CHUNK * kb + 3 * cols * kb),))
    return KernelGeometry(name=name, grid=plan.tasks, threads=plan.threads, registers=chunk.registers,
                          shared_bytes=chunk.shared_bytes, dram_bytes=dram_bytes,
                          members=(chunk, combine))
