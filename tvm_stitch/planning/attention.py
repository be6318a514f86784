"""The plan of one fused attention kernel: tiles, thread layout and the online-softmax state, as plain data.

An attention chain (analysis/attention_chain.py) computes, per (batch, head),
`O = softmax(scale * Q K^T + mask) V`. One kernel computes it a query tile
at a time, looping over key tiles with an online softmax: each query row
keeps a running max `m`, a running sum `l` and a rescaled partial output
`acc` (all float32); per key tile it computes the tile's scores, the new
max `m'`, rescales `l` and `acc` by `exp(m - m')` and adds the tile's
`exp(s - m')` and `exp(s - m') V`. The (q x kv) scores never leave the chip.

CUDA: a thread block per (batch, head, query tile); `lanes` threads per
query row split the head dimension (each holds `head_dim / lanes` float32
accumulators in registers) and the key tile's columns; Q, K and V tiles
are staged in shared memory (float32, rows padded by one element against
bank conflicts), the tile's scores in shared memory. The query tile and
key tile are the largest (from 64 and 64) that fit the spec's shared
memory per block with at least 64 threads.
CPU: a parallel task per (batch, KV head, query tile), holding the query
rows of every query head of that KV head (grouped-query attention: the heads
share each staged K and V tile); per key tile the scores (Q K^T) and the
update of the accumulators (P V) are register-blocked products, a block of
`block_rows` query rows by `score_cols` key columns (`out_cols` head-dim
columns) held in vector registers, and exp is a vectorisable polynomial
(topi.fast_exp's) where the pipeline's fast math is on; no (q x kv) buffer.
A causal mask is computed from the indices (key `j` is seen by query `i`
where `j <= i + kv_len - q_len`), key tiles past the diagonal are skipped;
an additive mask is read per key tile, broadcast as its shape says.
A symbolic batch or sequence length (a TIR expression of the Relax shape)
stays symbolic in the kernel (the grid, the key-tile loop and the row
guards are expressions of it); the tiles are chosen, and the traffic and
time priced, at its upper bound (`priced_at`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tvm_stitch.analysis.shape_dims import at_least, at_values, ceil_div, is_static, text
from tvm_stitch.planning import attention_kv_blocks, attention_mma
from tvm_stitch.planning.attention_cost import modeled_us
from tvm_stitch.planning.reasons import PlanError
from tvm_stitch.planning.spec import TargetSpec

MASK_KINDS = ("none", "causal", "additive")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
STATE = "per query row, float32: running max, running sum, rescaled partial output"


@dataclass(frozen=True)
class AttentionShape:
    """What the kernel computes: out[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, h // group, j] + mask) v[...]."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    scale: float
    mask: str  # one of MASK_KINDS
    mask_shape: tuple = ()  # additive: the mask tensor's 4-d shape (1 where broadcast)
    mask_dtype: str = ""
    operands: tuple = ()  # an OperandView each for Q, K, V (analysis/attention_operand.py); () reads 4-d tensors
    priced_at: tuple = ()  # symbolic sizes (a batch, the lengths: TIR expressions above): ((name, value), ...)
    #                        the value each is planned and priced at (its upper bound)

    def source(self, operand: int) -> tuple:
        """The shape of the tensor the kernel reads Q (0), K (1) or V (2) from."""
        if self.operands:
            return self.operands[operand].source
        rows = (self.heads, self.q_len) if operand == 0 else (self.kv_heads, self.kv_len)
        return (self.batch, *rows, self.head_dim)

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention; 1 for multi-head attention)."""
        return self.heads // self.kv_heads

    def mask_index(self, b, h, i, j) -> list:
        """The index of the additive mask's element for (batch, head, query, key): 0 on its axes of extent 1."""
        return [index if not (is_static(extent) and extent == 1) else 0
                for index, extent in zip((b, h, i, j), self.mask_shape)]

    def priced(self) -> AttentionShape:
        """This shape with its symbolic sizes at the values it is planned and priced at (all ints)."""
        if not self.priced_at:
            return self
        values = dict(self.priced_at)

        def fixed(shape):
            return tuple(at_values(d, values) for d in shape)

        operands = tuple(dataclasses.replace(view, source=fixed(view.source), cos=fixed(view.cos), sin=fixed(view.sin),
                                             steps=()) for view in self.operands)
        return dataclasses.replace(self, batch=at_values(self.batch, values), q_len=at_values(self.q_len, values),
                                   kv_len=at_values(self.kv_len, values), mask_shape=fixed(self.mask_shape),
                                   operands=operands, priced_at=())


@dataclass(frozen=True)
class AttentionPlan:
    """How the kernel runs: `shape`, the tiles and the thread layout (CUDA) for `spec`."""

    shape: AttentionShape
    spec: TargetSpec
    q_tile: int
    k_tile: int
    lanes: int = 1  # CUDA: threads per query row (they split the head dimension and the key tile)
    state: str = STATE
    shared_heads: int = 1  # CPU: query heads of one task, sharing each staged K and V tile
    block_rows: int = 1  # CPU: query rows of a register block
    score_cols: int = 0  # CPU: key columns of a register block of scores
    out_cols: int = 0  # CPU: head-dim columns of a register block of the P V update
    fast_exp: bool = False  # CPU: exp as topi.fast_exp's polynomial (vectorised), else libm's (scalar)
    mma: bool = False  # CUDA: on tensor cores (mma.sync m16n8k16), a warp per 16 query rows (attention_mma.py)
    kv_splits: int = 1  # CUDA tensor cores: warps per 16 query rows, each taking k_tile / kv_splits keys of a tile
    kv_blocks: int = 1  # CUDA tensor cores: blocks per query tile, each taking a chunk of its key tiles
    #                     (attention_kv_blocks.py: partials in a workspace, combined by the last to arrive)

    @property
    def q_tiles(self):
        return ceil_div(self.shape.q_len, self.q_tile)

    @property
    def k_tiles(self):
        return ceil_div(self.shape.kv_len, self.k_tile)

    @property
    def tasks(self) -> int:
        """Thread blocks (CUDA) or parallel tasks (CPU): one per (batch, `shared_heads` heads, query tile)
        and chunk of its key range (`kv_blocks`)."""
        return self.shape.batch * self.shape.heads // self.shared_heads * self.q_tiles * self.kv_blocks

    @property
    def rows(self) -> int:
        """Query rows of one task (CPU: `shared_heads` heads of `q_tile` rows each)."""
        return self.shared_heads * self.q_tile

    def priced(self) -> AttentionPlan:
        """The plan at its shape's priced sizes (AttentionShape.priced): what the cost model reads."""
        return dataclasses.replace(self, shape=self.shape.priced()) if self.shape.priced_at else self

    @property
    def threads(self) -> int:
        if self.mma:
            return self.q_tile // 16 * self.kv_splits * self.spec.warp_size
        return self.q_tile * self.lanes if self.spec.family == "cuda" else 1

    def shared_bytes(self) -> int:
        """CUDA: shared memory per block (Q, K, V tiles and the scores, float32, rows padded; on tensor
        cores Q, K and V in their dtype, rows padded by 8 elements, and where the key tile is split
        over warps the float32 combine: each split's row max and sum, and the summed output)."""
        if self.mma:
            return attention_mma.shared_bytes(self.q_tile, self.k_tile, self.kv_splits, self.shape.head_dim)
        return cuda_shared_bytes(self.q_tile, self.k_tile, self.shape.head_dim)

    def describe(self) -> str:
        s = self.shape
        tasks = text(self.tasks)
        split = (f", each key tile split over {self.kv_splits} warps of {self.k_tile // self.kv_splits} keys "
                 f"combined in shared memory" if self.kv_splits > 1 else "")
        if self.kv_blocks > 1:
            split += (f", the key range cut into {self.kv_blocks} chunks of {-(-self.k_tiles // self.kv_blocks)} "
                      f"key tiles, a block each, combined by the last to arrive")
        rows = (f"a warp per 16 query rows{split}, mma.sync m16n8k16 {s.dtype}" if self.mma
                else f"{self.lanes} per query row")
        where = (f"{tasks} blocks x {self.threads} threads ({rows}), "
                 f"{self.shared_bytes()} B shared" if self.spec.family == "cuda" else
                 f"{tasks} tasks of {self.shared_heads} head(s) x {self.q_tile} rows, register blocks "
                 f"{self.block_rows}x{self.score_cols} (Q K^T), {self.block_rows}x{self.out_cols} (P V), "
                 f"exp {'fast' if self.fast_exp else 'libm'}")
        heads = f"{s.heads} heads" + (f" over {s.kv_heads} KV heads" if s.group > 1 else "")
        read = "".join(f"; {name} read from {view.describe()}" for name, view in zip("QKV", s.operands)
                       if view.absorbed)
        sizes = (" (symbolic, planned at " + ", ".join(f"{n}={v}" for n, v in s.priced_at) + ")"
                 if s.priced_at else "")
        return (f"attention {text(s.batch)}x{heads}, q {text(s.q_len)} x kv {text(s.kv_len)}{sizes}, head dim {s.head_dim}, {s.dtype}, "
                f"mask {s.mask}: query tile {self.q_tile}, key tile {self.k_tile}, {where}; online softmax "
                f"({self.state}){read}")


def cuda_shared_bytes(q_tile: int, k_tile: int, head_dim: int) -> int:
    return 4 * ((q_tile + 2 * k_tile) * (head_dim + 1) + q_tile * (k_tile + 1))


def check_shape(shape: AttentionShape) -> None:
    """PlanError where the kernel does not compute `shape`."""
    if shape.dtype not in FLOAT_DTYPES:
        raise PlanError("attention-dtype", dtype=shape.dtype)
    if shape.mask not in MASK_KINDS:
        raise PlanError("attention-mask", mask=shape.mask)
    if shape.kv_heads <= 0 or shape.heads % shape.kv_heads:
        raise PlanError("attention-heads", heads=shape.heads, kv_heads=shape.kv_heads)
    if shape.mask == "causal" and not at_least(shape.kv_len, shape.q_len):
        raise PlanError("attention-causal-short", q_len=shape.q_len, kv_len=shape.kv_len)


def plan_cuda(shape: AttentionShape, spec: TargetSpec) -> AttentionPlan:
    """Of the tiles that fit the spec's shared memory and threads per block, those the time model
    (planning/attention_cost.py) prices fastest; among equals the fewest key splits, then the query
    tile nearest 64 rows (4 warps of the tensor-core kernel), then the largest."""
    check_shape(shape)
    d, priced = shape.head_dim, shape.priced()
    lanes = next((n for n in (4, 2, 1) if d % n == 0 and d // n <= 32), None)
    if lanes is None:
        raise PlanError("attention-head-dim", head_dim=d)
    fitting = [AttentionPlan(shape, spec, q_tile=min(q_tile, _pow2_at_least(priced.q_len, 16)), k_tile=k_tile,
                             lanes=lanes)
               for q_tile in (64, 32, 16) for k_tile in (64, 32, 16)
               if k_tile % lanes == 0 and q_tile * lanes <= spec.max_threads_per_block
               and cuda_shared_bytes(q_tile, k_tile, d) <= spec.shared_bytes_per_block]
    mma = attention_mma.candidates(shape, spec, AttentionPlan)
    fitting += mma + attention_kv_blocks.candidates(mma)
    if not fitting:
        raise PlanError("attention-shared-memory", head_dim=d, limit=spec.shared_bytes_per_block)
    return min(fitting, key=lambda plan: (max(modeled_us(plan), 0.0), plan.kv_blocks, plan.kv_splits, abs(plan.q_tile.bit_length() - 7),
                                          -plan.q_tile))


def plan_cpu(shape: AttentionShape, spec: TargetSpec, fast_exp: bool = True) -> AttentionPlan:
    """Register blocks of `block_rows` rows x 4 vectors (the accumulators take half of the spec's vector
    registers: 4 x 64 floats on AVX-512, 2 x 32 on AVX2); a key tile of one such block's columns; the
    query heads of a KV head in one task; query tiles of at most 128 rows a task (Q, the accumulators,
    the scores, K, K^T and V: 144 KB at head dim 64, within a core's level-2 cache), halved while there
    are fewer than 4 tasks per core (causal tasks differ in work)."""
    check_shape(shape)
    priced = shape.priced()
    lanes = max(spec.vector_bytes // 4, 4)
    block_rows = max(1, spec.vector_registers // 8)
    k_tile = min(4 * lanes, _pow2_at_least(priced.kv_len, lanes))
    q_tile = min(_pow2_at_most(max(128 // shape.group, block_rows)), _pow2_at_least(priced.q_len, block_rows))
    while q_tile > block_rows and priced.batch * shape.kv_heads * -(-priced.q_len // q_tile) < 4 * spec.cores:
        q_tile //= 2
    return AttentionPlan(shape, spec, q_tile=q_tile, k_tile=k_tile, shared_heads=shape.group,
                         block_rows=block_rows, score_cols=math.gcd(k_tile, 4 * lanes),
                         out_cols=math.gcd(shape.head_dim, 4 * lanes), fast_exp=fast_exp)


def plan_attention(shape: AttentionShape, spec: TargetSpec, fast_exp: bool = True) -> AttentionPlan:
    """The plan for `spec`; `fast_exp` (CPU): exp as a vectorisable polynomial."""
    return plan_cuda(shape, spec) if spec.family == "cuda" else plan_cpu(shape, spec, fast_exp)


def _pow2_at_least(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)
