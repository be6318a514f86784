"""TVM's default path for an attention chain, priced by the same time model as the fused kernel.

The default path is two batched matmuls (Q K^T and P V, dlight's rules, on
tensor cores in float16 and bfloat16) around the scale, mask and softmax,
with the (q x kv) scores written and read between them. It is priced as
TVM's default pipeline (target.default_pipeline) builds the chain at the
shape's priced sizes: every kernel of every PrimFunc of the lowered module
priced from its TIR (pricing/modeled_time.py), as
tools/module_time.default_module_time prices a whole module. Two
simplifications make the default no slower than it is: K and V are given
with the query heads' count (a grouped-query chain's repeat of its KV heads
is not priced), and a causal chain reads a (batch, 1, 1, kv) mask in place
of its constant (q x kv) one (the same launches, the softmax reading less;
no (q x kv) constant evaluated per shape). Lowering takes TVM's pipeline
seconds to minutes at long sequences (90 s at 32 heads x 2048 x 2048), so a
floor is taken first (`default_floor_us`): the default path launches at
least three kernels (a matmul, the softmax, a matmul) and moves the scores
at least four times (written, read and written by the softmax, read),
besides Q, K, V and O; a fused kernel modeled below the floor needs no
lowering.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.modeled_time import modeled_times
from tvm_stitch.target import default_pipeline


def chain_module(shape) -> tvm.IRModule:
    """The unfused chain of `shape` (AttentionShape, at its priced sizes) as a Relax module: matmul(Q, K^T),
    scale, [+ mask], softmax, matmul(P, V)."""
    s = shape.priced()
    rows, keys = (s.batch, s.heads, s.q_len, s.head_dim), (s.batch, s.heads, s.kv_len, s.head_dim)
    params = [relax.Var(name, relax.TensorType(dims, s.dtype)) for name, dims in (("q", rows), ("k", keys),
                                                                                         ("v", keys))]
    if s.mask != "none":
        params.append(relax.Var("mask", relax.TensorType((s.batch, 1, 1, s.kv_len), s.dtype)))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = params[:3]
            scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            scores = bb.emit(relax.op.multiply(scores, relax.const(s.scale, s.dtype)))
            if s.mask != "none":
                scores = bb.emit(relax.op.add(scores, params[3]))
            out = bb.emit_output(relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, axis=-1)), v))
        bb.emit_func_output(out)
    return bb.get()


DEFAULT_LAUNCHES = 3  # at least: Q K^T, the softmax, P V
SCORE_PASSES = 4  # the scores written, read and written by the softmax, read by P V


def default_floor_us(shape, spec: TargetSpec) -> float:
    """A lower bound of TVM's default path for the chain `shape` on the CUDA `spec`: its launches and its
    device-memory bytes (the scores' passes, Q, K, V and O once) at the spec's bandwidth."""
    s = shape.priced()
    element = 4 if s.dtype == "float32" else 2
    scores = s.batch * s.heads * s.q_len * s.kv_len * element
    operands = (2 * s.heads * s.q_len + 2 * s.kv_heads * s.kv_len) * s.batch * s.head_dim * element
    return DEFAULT_LAUNCHES * spec.launch_us + (SCORE_PASSES * scores + operands) / spec.hbm_bytes_per_us


def default_us(shape, target, spec: TargetSpec) -> float:
    """Modeled microseconds of TVM's default build of the chain `shape` for the CUDA `target` (a launch per
    kernel of each PrimFunc: the chain calls each once); -1 where a kernel is not priced."""
    with target:
        lowered = default_pipeline(target)(chain_module(shape))
    total = 0.0
    for _, func in lowered.functions_items():
        if isinstance(func, tirx.PrimFunc):
            times = modeled_times(func, spec)
            if times is None:
                return -1.0
            total += sum(t.us for t in times)
    return total
