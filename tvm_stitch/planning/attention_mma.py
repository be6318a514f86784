"""Plans of the attention kernel on tensor cores (schedules/cuda/attention_mma.py) and its launch geometry.

Where the spec's warp-level mma.sync m16n8k16 takes the chain's dtype
(`TargetSpec.mma_dtypes`: float16 and bfloat16 from sm_80) and the head
dimension is a multiple of 16, the CUDA attention kernel can run its two
products on tensor cores: a warp per 16 query rows (query tiles of 16 to
128 rows a block), key tiles streamed through shared memory. A key tile
may be split over `kv_splits` warps of the same 16 query rows, each
taking its own 16 to 64 keys of the tile (their running max, sum and
output combined through shared memory at the end): more warps on one
query tile where there are too few query tiles to fill the SMs (a cross
attention of 128 queries). The candidates are those whose Q, K and V
tiles (input dtype, rows padded by 8 elements) and combine buffers fit
the spec's shared memory per block and whose fragments fit a thread's
registers (and the block the SM's); planning/attention.py prices them
beside the FMA kernel's and keeps the fastest.

The geometry the time model reads (planning/time_model.py): per thread,
the staging loads of Q once and of K and V per key tile visited (16 bytes
a load), the output stores; 2 barriers per key tile (and two per split
at the combine); the mma arithmetic
(2 x 2 x rows x keys visited x head dim per block, on the dtype's tensor
unit), the softmax's float32 work on the accumulator fragments (scale,
mask, max, exp argument, sum, rescale of the output: about 6 operations
per score and 1 per output accumulator per tile) and its exps; device
memory as planning/attention_cost.traffic models it (Q, K, V, O once per
tile pass, K and V once where they stay in L2).
"""

from __future__ import annotations

from types import MappingProxyType

from tvm_stitch.planning.time_model import KernelGeometry

TILE = 16  # query rows of a warp; the k-depth of one mma
VECTOR = 16  # bytes a thread stages per load
REGISTER_LIMIT = 255  # registers a CUDA thread may hold
REGISTERS_BESIDE_FRAGMENTS = 48  # indices, addresses, row statistics, loop counters
SOFTMAX_OPS_PER_SCORE = 6  # float32 operations per score: scale, mask/select, max, exp argument, sum, convert
COMBINE_OPS_PER_SPLIT = 8  # per split and row pair of a lane: read its max and sum, the row max, exp, sum
Q_TILES = (16, 32, 64, 128)  # query rows of a block
KV_SPLITS = (1, 2, 4, 8)  # warps per 16 query rows, splitting each key tile
WARP_KEYS = (16, 32, 64)  # keys of one warp per key tile
TENSOR_UNITS = MappingProxyType({"float16": "fp16_tc", "bfloat16": "bf16_tc"})


def supported(shape, spec) -> bool:
    """Whether the chain can run on the tensor-core kernel for `spec`."""
    return (spec.family == "cuda" and shape.dtype in spec.mma_dtypes and shape.head_dim % TILE == 0
            and shape.head_dim <= 256)


def registers(head_dim: int, warp_keys: int) -> int:
    """A thread's registers: Q's A fragments (head_dim / 4 32-bit registers of two halves), the scores of
    its warp's keys (warp_keys / 2 float32) and P (warp_keys / 4), the output accumulators (head_dim / 2),
    one B fragment."""
    return head_dim // 4 + warp_keys // 2 + warp_keys // 4 + head_dim // 2 + 4 + REGISTERS_BESIDE_FRAGMENTS


def shared_bytes(q_tile: int, k_tile: int, kv_splits: int, head_dim: int) -> int:
    """Q, K and V tiles (2-byte elements, rows padded by 8); split key tiles add the float32 combine:
    each split's row max and sum, and the output tile the splits are summed into."""
    combine = 4 * q_tile * (head_dim + 2 * kv_splits) if kv_splits > 1 else 0
    return 2 * (q_tile + 2 * k_tile) * (head_dim + 8) + combine


def candidates(shape, spec, plan_type) -> list:
    """The tensor-core plans (of `plan_type`, AttentionPlan) that fit `spec`; [] where none does: query
    tiles of 16 to 128 rows, each key tile split over 1 to 8 warps of 16 to 64 keys."""
    if not supported(shape, spec):
        return []
    out = []
    rows = shape.priced().q_len
    for q_tile in [q for q in Q_TILES if q == Q_TILES[0] or q // 2 < rows]:  # no tile of only padding warps
        for kv_splits in KV_SPLITS:
            for warp_keys in WARP_KEYS:
                plan = plan_type(shape, spec, q_tile=q_tile, k_tile=kv_splits * warp_keys, mma=True,
                                 kv_splits=kv_splits)
                if _fits(plan, spec, registers(shape.head_dim, warp_keys)):
                    out.append(plan)
    return out


def _fits(plan, spec, thread_registers: int) -> bool:
    return (plan.threads <= spec.max_threads_per_block and plan.shared_bytes() <= spec.shared_bytes_per_block
            and thread_registers <= REGISTER_LIMIT and thread_registers * plan.threads <= spec.registers_per_sm)


def geometry(plan, dram_bytes: int, visited: float, name: str = "fused_attention") -> KernelGeometry:
    """The CUDA launch of a tensor-core plan (symbolic sizes priced) as the time model reads it;
    `dram_bytes`: its modeled traffic, `visited`: the share of key tiles it visits (attention_cost)."""
    s = plan.shape
    threads, splits = plan.threads, plan.kv_splits
    tiles = max(1.0, plan.k_tiles * visited)
    per_load = VECTOR // 2  # elements of one staging load
    q_loads = -(-plan.q_tile * s.head_dim // (per_load * threads))
    kv_loads = 2 * -(-plan.k_tile * s.head_dim // (per_load * threads))
    scores = plan.q_tile * plan.k_tile // threads  # per thread and key tile
    outputs = TILE * s.head_dim // plan.spec.warp_size  # output accumulators of a lane
    mma_ops = 4.0 * plan.q_tile * plan.k_tile * s.head_dim * tiles / threads
    combine = (COMBINE_OPS_PER_SPLIT * splits + outputs) if splits > 1 else 0
    softmax_ops = (SOFTMAX_OPS_PER_SCORE * scores + outputs) * tiles + combine
    return KernelGeometry(
        name=name, grid=plan.tasks, threads=threads,
        loads=((VECTOR, q_loads + round(kv_loads * tiles)),), stores=((4, outputs // 2),),
        load_sites=kv_loads, load_phases=round(tiles) + 1,
        barriers=round(2 * tiles) + 2 * splits - 1 if splits > 1 else round(2 * tiles),
        serial_iterations=round(tiles * (scores // 2 + 4)) + combine, sfu_ops=(scores + 2) * tiles + 2 * splits,
        registers=registers(s.head_dim, plan.k_tile // splits), shared_bytes=plan.shared_bytes(),
        dram_bytes=dram_bytes,
        flops=((TENSOR_UNITS[s.dtype], mma_ops), ("fp32", softmax_ops)))
