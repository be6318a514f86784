"""TVM's default path for an attention chain, priced by the same time model as the fused kernel.

The default path is two batched matmuls (Q K^T and P V, TVM's dlight rules,
on tensor cores in float16 and bfloat16) around the scale, mask and softmax
kernels, with the (q x kv) scores written and read between them. It is
priced as TVM's default pipeline builds the chain at the shape's priced
sizes (tools/module_time.default_module_time: every kernel's geometry from
its lowered TIR). A causal chain is priced with a read mask of
(batch, 1, 1, kv) in place of its constant (q x kv) one: the same launches,
the softmax reading less (the default path is priced no slower than it is),
without evaluating a (q x kv) constant at every length.
"""

from __future__ import annotations

from tvm_stitch.planning.spec import TargetSpec


def default_us(shape, target, spec: TargetSpec) -> float:
    """Modeled microseconds of TVM's default build of the chain `shape` (AttentionShape) for the CUDA
    `target`; -1 where it is not priced."""
    from tvm_stitch.tools.module_time import default_module_time
    from tvm_stitch.tools.workloads.attention import Chain

    s = shape.priced()
    chain = Chain(s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, s.dtype, kv_heads=s.kv_heads,
                  mask="none" if s.mask == "none" else "additive", form="4d")
    return default_module_time(chain.module(), target, spec).us
