"""The unfused computation of an `AttentionShape` as one PrimFunc (TE, unscheduled), with the fused
kernel's parameters: the reference the SIMT checker compares the fused CUDA kernel with on llvm."""

from __future__ import annotations

from tvm import te, tirx

from tvm_stitch.analysis.attention_operand import source_index


def reference_func(shape) -> tirx.PrimFunc:
    """q, k, v, [mask], out -> out = softmax(scale q k^T + mask) v, the scores materialised (float32);
    Q, K, V read from q, k, v through the shape's operand views."""
    s = shape
    sources = [te.placeholder(s.source(i), s.dtype, name) for i, name in enumerate("qkv")]
    tables = {f"{n}_{t}": te.placeholder(getattr(view, t), view.table_dtype, f"{n}_{t}")
              for n, view in zip("qkv", s.operands) for t in (("cos", "sin") if view.cos else ())}
    q, k, v = (_viewed(s, sources, i, tables) for i in range(3))
    mask = te.placeholder(s.mask_shape, s.mask_dtype, "mask") if s.mask == "additive" else None
    d = te.reduce_axis((0, s.head_dim), "d")

    raw = te.compute((s.batch, s.heads, s.q_len, s.kv_len),
                     lambda b, h, i, j: te.sum(q[b, h, i, d].astype("float32")
                                               * k[b, h // s.group, j, d].astype("float32"), axis=d), "scores")

    def masked(b, h, i, j):
        value = raw[b, h, i, j] * tirx.const(s.scale, "float32")
        if mask is not None:
            value = value + mask[tuple(s.mask_index(b, h, i, j))].astype("float32")
        if s.mask == "causal":
            value = tirx.Select(j <= i + (s.kv_len - s.q_len), value, tirx.const(-3.0e38, "float32"))
        return value

    logits = te.compute(raw.shape, masked, "logits")
    j1 = te.reduce_axis((0, s.kv_len), "j1")
    row_max = te.compute(raw.shape[:3], lambda b, h, i: te.max(logits[b, h, i, j1], axis=j1), "row_max")
    e = te.compute(raw.shape, lambda b, h, i, j: te.exp(logits[b, h, i, j] - row_max[b, h, i]), "e")
    j2 = te.reduce_axis((0, s.kv_len), "j2")
    row_sum = te.compute(raw.shape[:3], lambda b, h, i: te.sum(e[b, h, i, j2], axis=j2), "row_sum")
    j3 = te.reduce_axis((0, s.kv_len), "j3")
    acc = te.compute(q.shape, lambda b, h, i, c: te.sum(e[b, h, i, j3] * v[b, h // s.group, j3, c].astype("float32"),
                                                        axis=j3), "acc")
    out = te.compute(q.shape, lambda b, h, i, c: (acc[b, h, i, c] / row_sum[b, h, i]).astype(s.dtype), "out")
    args = sources + ([mask] if mask is not None else []) + list(tables.values()) + [out]
    return te.create_prim_func(args)


def _viewed(shape, sources: list, operand: int, tables: dict):
    """Q (0), K (1) or V (2) as a tensor of the reference: its source, or the source read through its views
    (and its rotary embedding, computed in float32 and rounded to the dtype)."""
    if not shape.operands:
        return sources[operand]
    source, view, name = sources[operand], shape.operands[operand], "qkv"[operand]
    rows = (shape.heads, shape.q_len) if operand == 0 else (shape.kv_heads, shape.kv_len)
    out = (shape.batch, *rows, shape.head_dim)
    x = te.compute(out, lambda *idx: source[tuple(source_index(view, idx))], f"{name}_view")
    if not view.cos:
        return x
    half = shape.head_dim // 2

    def rotary(b, h, i, d):
        cos, sin = (tables[f"{name}_{t}"][tuple(view.table_index(t, b, i, d))].astype("float32")
                    for t in ("cos", "sin"))
        rot = tirx.Select(d < half, -x[b, h, i, (d + half) % shape.head_dim].astype("float32"),
                          x[b, h, i, (d + half) % shape.head_dim].astype("float32"))
        return (x[b, h, i, d].astype("float32") * cos + rot * sin).astype(shape.dtype)

    return te.compute(out, rotary, f"{name}_rotary")
