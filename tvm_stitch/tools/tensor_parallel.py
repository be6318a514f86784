"""A tensor-parallel LLaMA-style block as one Relax module per shard (MLC-LLM's sharding), and its check.

Each shard holds its heads of the column-parallel Q, K, V projections and
the matching rows of the row-parallel output projection, its columns of
the column-parallel gate and up projections and the matching rows of the
row-parallel down projection. The row-parallel outputs are partial sums:
`R.ccl.allreduce` adds them across shards, then the residual add and the
next RMSNorm run on the full hidden size (local shapes everywhere else).
The block: RMSNorm, causal attention (no rotary embedding), residual,
RMSNorm, SwiGLU MLP, residual, and the next block's RMSNorm.

`worker` runs one shard in a torch.distributed rank (the collectives over
torch.distributed, `tvm_stitch.torch.disco_collectives`); `launch` spawns
the ranks on 127.0.0.1 and returns each rank's outputs.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np

EPS = 1e-6


@dataclass(frozen=True)
class BlockSize:
    tokens: int = 16
    hidden: int = 64
    heads: int = 4
    ffn: int = 160


def weights(size: BlockSize, seed: int = 0) -> dict:
    """The unsharded block's weights and input, float32, (in, out) layouts."""
    rng = np.random.default_rng(seed)
    d, f = size.hidden, size.ffn

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / math.sqrt(rows)).astype("float32")

    return {"x": rng.standard_normal((size.tokens, d)).astype("float32"),
            "norm1": (1 + 0.1 * rng.standard_normal(d)).astype("float32"),
            "wq": matrix(d, d), "wk": matrix(d, d), "wv": matrix(d, d), "wo": matrix(d, d),
            "norm2": (1 + 0.1 * rng.standard_normal(d)).astype("float32"),
            "gate": matrix(d, f), "up": matrix(d, f), "down": matrix(f, d),
            "norm3": (1 + 0.1 * rng.standard_normal(d)).astype("float32")}


PARAMS = ("x", "norm1", "wq", "wk", "wv", "wo", "norm2", "gate", "up", "down", "norm3")
COLUMN_PARALLEL, ROW_PARALLEL = ("wq", "wk", "wv", "gate", "up"), ("wo", "down")


def shard(block: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s weights: column-parallel ones split by columns, row-parallel ones by rows."""
    def piece(name, value):
        if name in COLUMN_PARALLEL:
            return np.ascontiguousarray(np.split(value, world, axis=1)[rank])
        if name in ROW_PARALLEL:
            return np.ascontiguousarray(np.split(value, world, axis=0)[rank])
        return value

    return {name: piece(name, value) for name, value in block.items()}


def reference(block: dict, size: BlockSize) -> tuple:
    """(residual stream after the block, the next block's RMSNorm of it) in numpy, unsharded."""
    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * w

    x, heads, t = block["x"], size.heads, size.tokens
    n = norm(x, block["norm1"])
    q, k, v = ((n @ block[w]).reshape(t, heads, -1).transpose(1, 0, 2) for w in ("wq", "wk", "wv"))
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1]) + np.triu(np.full((t, t), -1e4, "float32"), 1)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    attention = (scores / scores.sum(-1, keepdims=True)) @ v
    h = x + attention.transpose(1, 0, 2).reshape(t, -1) @ block["wo"]
    n = norm(h, block["norm2"])
    gate = n @ block["gate"]
    y = h + (gate / (1 + np.exp(-gate)) * (n @ block["up"])) @ block["down"]
    return y, norm(y, block["norm3"])


def shard_module(size: BlockSize, world: int, dtype: str = "float32"):
    """The Relax module of one shard: main(x, norm1, wq, wk, wv, wo, norm2, gate, up, down, norm3)."""
    from tvm import relax

    d, t, local_heads = size.hidden, size.tokens, size.heads // world
    head = d // size.heads
    shapes = {"x": (t, d), "norm1": (d,), "wq": (d, d // world), "wk": (d, d // world), "wv": (d, d // world),
              "wo": (d // world, d), "norm2": (d,), "gate": (d, size.ffn // world), "up": (d, size.ffn // world),
              "down": (size.ffn // world, d), "norm3": (d,)}
    params = {name: relax.Var(name, relax.TensorType(shapes[name], dtype)) for name in PARAMS}
    builder = relax.BlockBuilder()
    with builder.function("main", list(params.values())):
        with builder.dataflow():
            out = _emit_block(builder, params, (t, local_heads, head), world, dtype)
            result = builder.emit_output(out)
        builder.emit_func_output(result)
    return builder.get()


def _emit_block(builder, p, sizes, world, dtype):
    from tvm import relax

    (t, local_heads, head), op, emit = sizes, relax.op, builder.emit
    mask = relax.const(np.triu(np.full((t, t), -1e4, dtype), 1))
    n = emit(op.nn.rms_norm(p["x"], p["norm1"], axes=[-1], epsilon=EPS))
    q, k, v = (emit(op.permute_dims(op.reshape(op.matmul(n, p[w]), (t, local_heads, head)), [1, 0, 2]))
               for w in ("wq", "wk", "wv"))
    scores = emit(op.add(op.divide(op.matmul(q, op.permute_dims(k, [0, 2, 1])),
                                   relax.const(math.sqrt(head), dtype)), mask))
    attention = emit(op.matmul(op.nn.softmax(scores, axis=-1), v))
    merged = emit(op.reshape(op.permute_dims(attention, [1, 0, 2]), (t, local_heads * head)))
    h = emit(op.add(p["x"], _all_reduce(emit, op.matmul(merged, p["wo"]), world)))
    n = emit(op.nn.rms_norm(h, p["norm2"], axes=[-1], epsilon=EPS))
    mlp = emit(op.matmul(op.multiply(op.nn.silu(op.matmul(n, p["gate"])), op.matmul(n, p["up"])), p["down"]))
    y = emit(op.add(h, _all_reduce(emit, mlp, world)))
    return relax.Tuple([y, emit(op.nn.rms_norm(y, p["norm3"], axes=[-1], epsilon=EPS))])


def _all_reduce(emit, partial, world: int):
    from tvm import relax

    partial = emit(partial)
    return emit(relax.op.ccl.allreduce(partial, "sum")) if world > 1 else partial


def worker(rank: int, world: int, port: int, size: BlockSize, out_dir: str) -> None:
    """Rank `rank`: its shard built with the stitch pipeline for this CPU, run on its weights."""
    import torch.distributed as dist

    from tvm_stitch.target import host_target
    from tvm_stitch.tools.build import build, run_cpu
    from tvm_stitch.torch.disco_collectives import register

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        register()
        built = build(shard_module(size, world), host_target(), stitched=True)
        local = shard(weights(size), rank, world)
        outputs = run_cpu(built.executable, [local[name] for name in PARAMS])
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), *outputs)
    finally:
        dist.destroy_process_group()


def launch(size: BlockSize = BlockSize(), world: int = 2) -> list:
    """Each rank's outputs (residual stream, its next RMSNorm) of the block run in `world` processes."""
    import torch.multiprocessing as mp

    from tvm_stitch.tools.dist_parity import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(world, free_port(), size, out_dir), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with np.load(os.path.join(out_dir, f"rank{rank}.npz")) as saved:
                results.append([saved[f"arr_{i}"] for i in range(len(saved.files))])
        return results
