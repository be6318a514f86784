"""What the CUDA and CPU attention kernels share: their parameters, the score of one (query, key) pair,
and which keys a query sees (kernels built with TVM's IR builder from an `AttentionPlan`)."""

from __future__ import annotations

import contextlib

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from tvm_stitch.analysis.attention_operand import source_index

NEG = -3.0e38  # the running max before any key, and the score of a key a query does not see


def arguments(shape) -> dict:
    """The kernel's signature in the current prim_func frame: its name and attributes (scheduled, so dlight
    leaves it alone), and its buffers, in call order: q, k, v (the tensors Q, K, V are read from), [mask],
    [the rotary tables: q_cos, q_sin, k_cos, ...], out."""
    s = shape
    T.func_name("fused_attention")
    T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
    bufs = {name: T.arg(name, T.buffer(s.source(i), s.dtype)) for i, name in enumerate("qkv")}
    if s.mask == "additive":
        bufs["mask"] = T.arg("mask", T.buffer(s.mask_shape, s.mask_dtype))
    for name, view in zip("qkv", s.operands):
        for table in ("cos", "sin") if view.cos else ():
            bufs[f"{name}_{table}"] = T.arg(f"{name}_{table}", T.buffer(getattr(view, table), view.table_dtype))
    bufs["out"] = T.arg("out", T.buffer((s.batch, s.heads, s.q_len, s.head_dim), s.dtype))
    return bufs


def load(buf, *indices):
    """buf[indices] as an expression (the IR builder's buffer indexing gives a TensorLoad)."""
    return tirx.BufferLoad(buf, [tirx.const(i, "int32") if isinstance(i, int) else i for i in indices])


def operand(shape, bufs, name: str, b, h, row, d):
    """Element (b, h, row, d) of Q, K or V (`name`), read from its source through its views (float32
    after a rotary embedding: x * cos + rotate_half(x) * sin)."""
    if not shape.operands:
        return load(bufs[name], b, h, row, d)
    view = shape.operands["qkv".index(name)]
    x = [load(bufs[name], *source_index(view, (b, h, row, col))) for col in (d, (d + shape.head_dim // 2)
                                                                             % shape.head_dim)]
    if not view.cos:
        return x[0]
    tables = [load(bufs[f"{name}_{t}"], *view.table_index(t, b, row, d)) for t in ("cos", "sin")]
    rotated = tirx.Select(d < shape.head_dim // 2, -f32(x[1]), f32(x[1]))
    return f32(x[0]) * f32(tables[0]) + rotated * f32(tables[1])


def f32(value):
    return value if str(value.ty) == "float32" else tirx.Cast("float32", value)


def seen(shape, qi, kj):
    """Whether query row `qi` sees key `kj`: inside the keys, and on or below the diagonal when causal
    (aligned at the end: key j is seen by query i where j <= i + kv_len - q_len)."""
    cond = kj < shape.kv_len
    if shape.mask == "causal":
        cond = tirx.all(cond, kj <= qi + (shape.kv_len - shape.q_len))
    return cond


def score(shape, bufs, dot, b, h, qi, kj):
    """scale * dot (+ the additive mask, broadcast over the mask's axes of extent 1), float32."""
    value = dot * tirx.const(shape.scale, "float32")
    if shape.mask != "additive":
        return value
    return value + f32(load(bufs["mask"], *shape.mask_index(b, h, qi, kj)))


def causal_key_tiles(plan, q0):
    """Key tiles a query tile starting at row `q0` needs (all of them unless causal)."""
    s = plan.shape
    if s.mask != "causal":
        return plan.k_tiles
    last_row = tirx.min(q0 + plan.q_tile, s.q_len) - 1
    return tirx.min(plan.k_tiles, (last_row + (s.kv_len - s.q_len)) // plan.k_tile + 1)


def cuda_kernel(plan, body, min_blocks_per_sm: int | None = None, workspaces=None) -> tirx.PrimFunc:
    """The PrimFunc (q, k, v, [mask], out) of a CUDA attention plan: `plan.tasks` blocks of `plan.threads`
    threads, `body(bufs, bx, tx)` writing a block's statements (under `__launch_bounds__(threads,
    min_blocks_per_sm)` where given); `workspaces`: {name: float32 elements} of global buffers the host
    allocates for the launch (uninitialised), in `bufs` under their names."""
    with IRBuilder() as ib:
        with T.prim_func(is_private=True):
            bufs = arguments(plan.shape)
            with T.sblock("root"):
                for name, elements in (workspaces or {}).items():
                    bufs[name] = T.alloc_buffer((elements,), "float32", scope="global")
                with T.thread_binding(plan.tasks, thread="blockIdx.x") as bx:
                    with T.thread_binding(plan.threads, thread="threadIdx.x") as tx:
                        bounds = (T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks_per_sm)
                                  if min_blocks_per_sm is not None else contextlib.nullcontext())
                        with bounds:
                            body(bufs, bx, tx)
    return ib.get()


def query_tile(plan, bx) -> tuple:
    """(batch, head, first query row) of CUDA block `bx`: blocks run over (batch, head, query tile).
    Block indices are non-negative: truncated division (no sign fix-up where q_tiles is symbolic)."""
    s, q_tiles = plan.shape, plan.q_tiles
    b, h = tirx.truncdiv(bx, s.heads * q_tiles), tirx.truncmod(tirx.truncdiv(bx, q_tiles), s.heads)
    return b, h, tirx.truncmod(bx, q_tiles) * plan.q_tile
