"""What an attention plan moves and how long the CUDA time model says it takes (plain numbers).

Traffic, as pricing/traffic.py models a kernel: Q read once, O written once;
K and V of one (batch, KV head) are read by every query tile of its query
heads (CPU: by every query tile, the heads of a KV head sharing its tiles), counted once where they fit the cache's resident share (the query
tiles of a head run at about the same time, the later ones find them in L2;
CPU: in the last-level cache), else at every read (causal: only the key tiles
up to the diagonal); an additive mask likewise, once or per (batch, head) it
is broadcast over; rotary embeddings' cos and sin tables once; a key range split across blocks
(attention_kv_blocks.py) writes its workspace of partials once and reads it once. Ideal: Q, K,
V, O, the mask and the tables once (Q, K, V read from the tensor they are
views of move the same bytes: a split projection is read once in all).
Symbolic sizes are counted at their priced values (their upper bounds).
The geometry for the time model (planning/time_model.py) counts a thread's
global accesses, barriers, serial iterations (the score dot products, the
max, the rescale and the P V update are serial FMA loops here), exps, and
its arithmetic: the two products' multiply-adds (2 x 2 x query rows x keys
visited x head dim per task) as FP32 FMA (`flops`).
"""

from __future__ import annotations

from tvm_stitch.planning import attention_kv_blocks, attention_mma
from tvm_stitch.planning.spec import CPU_RESIDENT_PER_MILLE, CUDA_RESIDENT_PER_MILLE
from tvm_stitch.planning.time_model import KernelGeometry, kernel_time

REGISTERS_BESIDE_ACCUMULATORS = 40  # indices, the running max and sum, a score, loop counters


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def visited_fraction(plan) -> float:
    """The share of (query tile, key tile) pairs the kernel visits (causal: up to the diagonal)."""
    plan = plan.priced()
    s = plan.shape
    if s.mask != "causal":
        return 1.0
    visited = sum(min(plan.k_tiles, (min((t + 1) * plan.q_tile, s.q_len) - 1 + s.kv_len - s.q_len) // plan.k_tile + 1)
                  for t in range(plan.q_tiles))
    return visited / (plan.q_tiles * plan.k_tiles)


def traffic(plan) -> tuple:
    """(loaded, stored, ideal) bytes of device (CPU: main) memory (symbolic sizes at their priced values)."""
    plan = plan.priced()
    s = plan.shape
    e = _bytes(s.dtype)
    resident = plan.spec.cache_bytes * (CUDA_RESIDENT_PER_MILLE if plan.spec.family == "cuda"
                                        else CPU_RESIDENT_PER_MILLE) // 1000
    q = s.batch * s.heads * s.q_len * s.head_dim * e
    kv_head = 2 * s.kv_len * s.head_dim * e
    kv = s.batch * s.kv_heads * kv_head
    readers = s.group // plan.shared_heads * plan.q_tiles  # tasks reading one KV head's tiles
    kv_read = kv if kv_head <= resident else round(kv * readers * visited_fraction(plan))
    mask = mask_read = 0
    if s.mask == "additive":
        mask = _elements(s.mask_shape) * _bytes(s.mask_dtype)
        broadcast = s.batch * s.heads // (s.mask_shape[0] * s.mask_shape[1])
        mask_read = mask if mask <= resident else mask * broadcast
    tables = sum(_elements(view.cos) + _elements(view.sin) for view in s.operands if view.cos)
    tables *= _bytes(next((view.table_dtype for view in s.operands if view.cos), "float32"))
    workspace = attention_kv_blocks.workspace_bytes(plan) if plan.kv_blocks > 1 else 0  # written, read once
    return q + kv_read + mask_read + tables + workspace, q + workspace, 2 * q + kv + mask + tables


def _elements(shape: tuple) -> int:
    n = 1
    for extent in shape:
        n *= extent
    return n


def geometry(plan, name: str = "fused_attention") -> KernelGeometry:
    """The CUDA launch of `plan` as the time model reads it (symbolic sizes at their priced values)."""
    plan = plan.priced()
    if plan.kv_blocks > 1:
        return attention_kv_blocks.geometry(plan, sum(traffic(plan)[:2]), name)
    if plan.mma:
        return attention_mma.geometry(plan, sum(traffic(plan)[:2]), visited_fraction(plan), name)
    s = plan.shape
    e = _bytes(s.dtype)
    lanes, threads = plan.lanes, plan.threads
    tiles = max(1.0, plan.k_tiles * visited_fraction(plan))
    staged = plan.k_tile * s.head_dim // threads  # elements of K (and of V) a thread stages per key tile
    per_tile = (2 * staged + plan.k_tile // lanes * s.head_dim + plan.k_tile + plan.k_tile // lanes
                + plan.k_tile * (s.head_dim // lanes))
    loaded, stored, _ = traffic(plan)
    return KernelGeometry(
        name=name, grid=plan.tasks, threads=threads,
        loads=((e, plan.q_tile * s.head_dim // threads + round(2 * staged * tiles)),),
        stores=((e, s.head_dim // lanes),),
        load_sites=2 * 4, load_phases=round(tiles) + 1, barriers=round(4 * tiles),
        serial_iterations=round(per_tile * tiles), sfu_ops=(plan.k_tile // lanes + 1) * tiles,
        registers=s.head_dim // lanes + REGISTERS_BESIDE_ACCUMULATORS, shared_bytes=plan.shared_bytes(),
        dram_bytes=loaded + stored,
        flops=(("fp32", 4.0 * plan.rows * plan.k_tile * tiles * s.head_dim / threads),))


def modeled_us(plan) -> float:
    """The time model's microseconds for one launch (CUDA plans; -1 for CPU plans)."""
    if plan.spec.family != "cuda" or plan.spec.hbm_bytes_per_us <= 0:
        return -1.0
    return kernel_time(geometry(plan), plan.spec).us
