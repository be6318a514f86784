"""Attention chains as one kernel (rewrites/attention.py): recognition, numerics on llvm against numpy
float64, one CUDA launch, modeled traffic, the SIMT checker, nvcc, fallbacks with their reasons."""

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from conftest import attention_simt, needs_nvcc, nvcc
from tvm_stitch.analysis.attention_chain import find_chains, mask_kind
from tvm_stitch.rewrites.attention import kernel_for, shape_of
from tvm_stitch.planning.attention import AttentionShape, plan_attention
from tvm_stitch.planning.attention_cost import modeled_us
from tvm_stitch.pricing.attention_default import default_us
from tvm_stitch.analysis.attention_operand import OperandView, source_index
from tvm_stitch.planning.reasons import PlanError
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches, cuda_source, launches_by_kind, program_traffic
from tvm_stitch.tools.workloads.attention import Chain
from tvm_stitch.tools.workloads.relax_blocks import function, tensor

CUDA = {"kind": "cuda", "arch": "sm_90"}
SMALL = [
    Chain(2, 4, 24, 40, 32, kv_heads=2, mask="causal"),  # GQA, causal aligned at the end, ragged tiles
    Chain(2, 2, 16, 50, 64, mask="additive"),  # padding mask read per key tile
    Chain(1, 2, 17, 33, 64, form="4d"),  # 4-d matmuls, cross-attention lengths
    Chain(1, 4, 16, 16, 128, "float16", kv_heads=2, mask="causal"),
]
# The issue's shapes: (batch, heads, q, kv, head_dim)
DONE_WHEN = [
    Chain(8, 12, 128, 128, 64),
    Chain(2, 12, 512, 512, 64),
    Chain(1, 32, 1024, 1024, 128, "float16", kv_heads=8, mask="causal"),
    Chain(1, 12, 128, 2048, 64),
]


def _run_llvm(chain: Chain, rng):
    built = build(chain.module(), host_target(), stitched=True)
    arrays = chain.inputs(rng)
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    return built, vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy(), chain.reference(arrays)


def _rel_error(got, want) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("chain", SMALL, ids=str)
def test_chain_is_one_kernel_matching_numpy_on_llvm(chain, rng):
    built, got, want = _run_llvm(chain, rng)
    prims = [gv.name_hint for gv, f in built.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims == ["fused_attention"]
    assert [r.plan.shape.mask for r in built.report.attention] == [chain.mask]
    assert _rel_error(got, want) < (1e-4 if chain.dtype == "float32" else 2e-3)


@pytest.mark.parametrize("chain", SMALL[:2] + SMALL[3:], ids=str)
def test_chain_is_one_cuda_launch_moving_q_k_v_o_once(chain):
    built = build(chain.module(), CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    assert launches_by_kind(built.lowered, built.executable) == (0, 1)  # two GEMMs: compute-intensive
    modeled, _ = program_traffic(built.lowered, CUDA)
    e = 4 if chain.dtype == "float32" else 2
    qkvo = sum(int(np.prod(s)) for s in chain.shapes()[:3]) * e + int(np.prod(chain.shapes()[0])) * e
    mask = int(np.prod(chain.shapes()[3])) * 4 if chain.mask == "additive" else 0
    assert abs(modeled - qkvo - mask) <= 0.1 * qkvo


def test_attention_weights_read_elsewhere_fall_back_with_reason(rng):
    """A chain whose probabilities are also returned keeps TVM's path (the softmax has a reader outside)."""
    q, k, v = (tensor(n, (1, 2, 8, 16), "float32") for n in "qkv")

    def body(bb, q, k, v):
        s = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])), relax.const(0.25, "float32")))
        p = bb.emit(op.nn.softmax(s, axis=-1))
        return relax.Tuple([bb.emit(op.matmul(p, v)), p])

    built = build(function([q, k, v], body), host_target(), stitched=True)
    assert [r.reason.code for r in built.report.attention] == ["attention-weights-read"]
    arrays = [rng.standard_normal((1, 2, 8, 16)).astype("float32") for _ in range(3)]
    out = relax.VirtualMachine(built.executable, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    want = Chain(1, 2, 8, 8, 16, form="4d").reference(arrays)
    assert _rel_error(out[0].numpy(), want) < 1e-5


def test_head_dim_without_a_lane_split_falls_back_with_reason():
    shape = AttentionShape(1, 2, 2, 16, 16, 256, "float32", 0.1, "none")
    with pytest.raises(PlanError) as err:
        plan_attention(shape, TargetSpec.from_target(tvm.target.Target(CUDA)))
    assert err.value.code == "attention-head-dim"
    built = build(Chain(1, 2, 16, 16, 256).module(), CUDA, stitched=True)
    assert [r.reason.code for r in built.report.attention] == ["attention-head-dim"]


def test_gqa_and_causal_mask_are_recognised():
    chain = find_chains(Chain(1, 8, 32, 32, 64, kv_heads=2, mask="causal").module()["main"])[0][0]
    shape = shape_of(chain)
    assert (shape.heads, shape.kv_heads, shape.mask, chain.mask) == (8, 2, "causal", None)


def test_cuda_plans_fit_the_spec():
    spec = TargetSpec.from_target(tvm.target.Target(CUDA))
    for chain in DONE_WHEN + SMALL:
        plan = plan_attention(shape_of(find_chains(chain.module()["main"])[0][0]), spec)
        assert plan.shared_bytes() <= spec.shared_bytes_per_block
        assert plan.threads <= spec.max_threads_per_block
        assert plan.mma or plan.shape.head_dim // plan.lanes <= 32  # an FMA lane's share of a row


def test_cuda_kernel_matches_under_simt_on_pocl():
    result = attention_simt(AttentionShape(1, 2, 1, 20, 40, 32, "float32", 0.125, "causal"), oclgrind=False)
    assert result.ok, result.detail


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    AttentionShape(1, 2, 2, 24, 50, 32, "float32", 0.2, "additive", (1, 1, 1, 50), "float32"),
    AttentionShape(1, 2, 1, 17, 40, 64, "float16", 0.1, "causal"),
    AttentionShape(1, 1, 1, 20, 33, 128, "bfloat16", 0.1, "none"),
], ids=str)
def test_cuda_kernel_is_clean_under_oclgrind(shape):
    result = attention_simt(shape, oclgrind=True)
    assert result.ok, result.detail


@pytest.mark.slow
@pytest.mark.parametrize("chain", DONE_WHEN, ids=str)
def test_issue_shapes_one_launch_traffic_and_llvm_numerics(chain, rng):
    """On CUDA a chain whose kernel is modeled slower than TVM's default path keeps that path
    (pricing/attention_default.py): in float32 the cross-attention (FMA kernel, 24 blocks: 282 vs 86 us) and
    (2, 12, 512, 512, 64) (72.8 vs 72.0 us)."""
    built = build(chain.module(), CUDA, stitched=True)
    [record] = built.report.attention
    shape = shape_of(find_chains(chain.module()["main"])[0][0])
    spec = TargetSpec.from_target(tvm.target.Target(CUDA))
    if modeled_us(plan_attention(shape, spec)) > default_us(shape, tvm.target.Target(CUDA), spec):
        assert record.reason.code == "attention-default-faster"
    else:
        assert record.fused and count_launches(built.lowered, built.executable) == 1
        modeled, ideal = program_traffic(built.lowered, CUDA)
        assert abs(modeled - ideal) <= 0.1 * ideal
    _, got, want = _run_llvm(chain, rng)
    assert _rel_error(got, want) < (1e-4 if chain.dtype == "float32" else 2e-3)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("chain", DONE_WHEN, ids=str)
def test_issue_shapes_compile_with_nvcc_without_spills(chain, tmp_path):
    built = build(chain.module(), CUDA, stitched=True)
    report = nvcc(cuda_source(built.executable), tmp_path, arch="sm_90")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    AttentionShape(8, 12, 12, 128, 128, 64, "float32", 0.125, "none"),
    AttentionShape(1, 32, 8, 128, 128, 128, "float16", 0.1, "causal"),
    AttentionShape(1, 12, 12, 32, 2048, 64, "float32", 0.125, "none"),
], ids=str)
def test_issue_like_shapes_match_under_simt_on_pocl(shape):
    result = attention_simt(shape, oclgrind=False)
    assert result.ok, result.detail


def test_bfloat16_plan_on_the_cpu_matches_numpy(rng):
    shape = AttentionShape(1, 2, 2, 20, 24, 64, "bfloat16", 0.125, "causal")
    plan = plan_attention(shape, TargetSpec.from_target(host_target()))
    lib = tvm.tirx.build(tvm.IRModule({"main": kernel_for(plan).with_attr("global_symbol", "main")}),
                         target=host_target())
    chain = Chain(1, 2, 20, 24, 64, "bfloat16", mask="causal")
    import ml_dtypes

    arrays = [a.astype(ml_dtypes.bfloat16) for a in chain.inputs(rng)[:3]]
    out = tvm.runtime.empty(arrays[0].shape, "bfloat16", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    assert _rel_error(out.numpy().astype(np.float32), chain.reference(arrays)) < 2e-2


def test_plans_are_plain_data():
    plan = plan_attention(AttentionShape(1, 2, 2, 16, 16, 64, "float32", 0.1, "none"),
                          TargetSpec.from_target(tvm.target.Target(CUDA)))
    assert dataclasses.asdict(plan)["q_tile"] == plan.q_tile and "online softmax" in plan.describe()


def test_mask_kind_reads_the_mask_values():
    causal = Chain(1, 1, 6, 8, 16, mask="causal").causal_mask()
    assert mask_kind(relax.const(np.repeat(causal, 2, axis=0)), 6, 8) == "causal"  # one slice per batch
    assert mask_kind(relax.const(np.zeros((2, 1, 6, 8), "float32")), 6, 8) == "none"
    shifted = causal.copy()
    shifted[..., 0, 3] = 0.0  # one key past the diagonal (query 0 sees keys 0..2) visible: not causal
    assert mask_kind(relax.const(shifted), 6, 8) == "additive"


def _head_split_module(batch, seq, heads, dim, sliced: bool):
    """GPT-2's head split: Q, K, V as split (or strided slices) + reshape + permute of a (batch, seq,
    3 * heads * dim) projection, K transposed, scaled scores, softmax, P V."""
    x = tensor("x", (batch, seq, 3 * heads * dim), "float32")
    width = heads * dim

    def body(bb, x):
        if sliced:
            parts = [bb.emit(op.strided_slice(x, [2], [i * width], [(i + 1) * width])) for i in range(3)]
        else:
            split = bb.emit(op.split(x, [width, 2 * width], axis=2))
            parts = [bb.emit(relax.TupleGetItem(split, i)) for i in range(3)]
        q, k, v = (bb.emit(op.permute_dims(bb.emit(op.reshape(p, (batch, seq, heads, dim))), [0, 2, 1, 3]))
                   for p in parts)
        s = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])), relax.const(dim ** -0.5, "float32")))
        return bb.emit(op.matmul(bb.emit(op.nn.softmax(s, axis=-1)), v))

    return function([x], body)


def _head_split_reference(x, heads, dim):
    b, s, _ = x.shape
    q, k, v = (p.reshape(b, s, heads, dim).transpose(0, 2, 1, 3).astype(np.float64) for p in np.split(x, 3, axis=2))
    scores = q @ k.transpose(0, 1, 3, 2) * dim ** -0.5
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("sliced", [False, True], ids=["split", "strided_slice"])
def test_head_split_is_read_in_place_on_llvm(sliced, rng):
    """Q, K, V as views of one projection: one kernel reading it in place, matching numpy."""
    built = build(_head_split_module(2, 24, 3, 32, sliced), host_target(), stitched=True)
    prims = [gv.name_hint for gv, f in built.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims == ["fused_attention"]
    plan = built.report.attention[0].plan
    assert [view.source for view in plan.shape.operands] == [(2, 24, 288)] * 3
    assert "Q read from 2x24x288 through slice axis 2 from 0" in plan.describe()
    x = rng.standard_normal((2, 24, 288)).astype("float32")
    got = relax.VirtualMachine(built.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert _rel_error(got, _head_split_reference(x, 3, 32)) < 1e-4


def test_head_split_is_one_cuda_launch_moving_the_projection_once():
    built = build(_head_split_module(1, 64, 4, 64, False), CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    modeled, _ = program_traffic(built.lowered, CUDA)
    projection, out = 64 * 3 * 4 * 64 * 4, 64 * 4 * 64 * 4
    assert abs(modeled - projection - out) <= 0.1 * (projection + out)


def test_operand_views_map_to_numpy_views():
    x = np.arange(2 * 6 * 36).reshape(2, 6, 36)
    view = OperandView((2, 6, 36), (("slice", (2, 6, 36), (2, 12, 1)), ("reshape", (2, 6, 12), (2, 6, 3, 4)),
                                    ("permute", (2, 6, 3, 4), (0, 2, 1, 3))))
    want = x[:, :, 12:24].reshape(2, 6, 3, 4).transpose(0, 2, 1, 3)
    index = np.indices(want.shape).reshape(4, -1)
    assert np.array_equal(x[tuple(source_index(view, index))], want.reshape(-1))


@pytest.mark.slow
def test_cuda_kernel_with_a_head_split_matches_under_simt_on_pocl():
    view = OperandView((1, 20, 192), (("slice", (1, 20, 192), (2, 64, 1)), ("reshape", (1, 20, 64), (1, 20, 2, 32)),
                                      ("permute", (1, 20, 2, 32), (0, 2, 1, 3))))
    shape = AttentionShape(1, 2, 2, 20, 20, 32, "float32", 0.125, "causal", operands=(view,) * 3)
    result = attention_simt(shape, oclgrind=False)
    assert result.ok, result.detail


def _rotary_module(seq, heads, kv_heads, dim):
    """LLaMA's attention inputs: Q and K projections split into heads, permuted, rotary-embedded
    (x * cos + rotate_half(x) * sin, tables (1, seq, dim) per position), K and V repeated over query heads."""
    xq, xk, xv = (tensor(n, (1, seq, h * dim), "float32") for n, h in (("xq", heads), ("xk", kv_heads),
                                                                      ("xv", kv_heads)))
    cos, sin = (tensor(n, (1, seq, dim), "float32") for n in ("cos", "sin"))

    def heads_of(bb, x, h):
        return bb.emit(op.permute_dims(bb.emit(op.reshape(x, (1, seq, h, dim))), [0, 2, 1, 3]))

    def rotary(bb, x, c, s):
        half = dim // 2
        high = bb.emit(op.negative(bb.emit(op.strided_slice(x, [3], [half], [dim]))))
        rot = bb.emit(op.concat([high, bb.emit(op.strided_slice(x, [3], [0], [half]))], axis=-1))
        return bb.emit(op.add(bb.emit(op.multiply(x, c)), bb.emit(op.multiply(rot, s))))

    def repeat(bb, x):
        x = bb.emit(op.broadcast_to(bb.emit(op.expand_dims(x, [2])), (1, kv_heads, heads // kv_heads, seq, dim)))
        return bb.emit(op.reshape(x, (1, heads, seq, dim)))

    def body(bb, xq, xk, xv, cos, sin):
        c, s = (bb.emit(op.expand_dims(t, [1])) for t in (cos, sin))
        q = rotary(bb, heads_of(bb, xq, heads), c, s)
        k = repeat(bb, rotary(bb, heads_of(bb, xk, kv_heads), c, s))
        v = repeat(bb, heads_of(bb, xv, kv_heads))
        scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])), relax.const(dim ** -0.5,
                                                                                                 "float32")))
        return bb.emit(op.matmul(bb.emit(op.nn.softmax(scores, axis=-1)), v))

    return function([xq, xk, xv, cos, sin], body)


def _rotary_reference(xq, xk, xv, cos, sin, heads, kv_heads, dim):
    def split(x, h):
        return x.reshape(1, -1, h, dim).transpose(0, 2, 1, 3).astype(np.float64)

    def rotary(x):
        rot = np.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], axis=-1)
        return x * cos[:, None] + rot * sin[:, None]

    q, k, v = rotary(split(xq, heads)), rotary(split(xk, kv_heads)), split(xv, kv_heads)
    k, v = (np.repeat(t, heads // kv_heads, axis=1) for t in (k, v))
    scores = q @ k.transpose(0, 1, 3, 2) * dim ** -0.5
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_rotary_embedding_is_applied_while_staging_on_llvm(rng):
    """LLaMA's Q and K (head split, rotary embedding, repeated KV heads): one kernel, matching numpy."""
    built = build(_rotary_module(20, 4, 2, 32), host_target(), stitched=True)
    prims = [gv.name_hint for gv, f in built.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims == ["fused_attention"]
    views = built.report.attention[0].plan.shape.operands
    assert [bool(view.cos) for view in views] == [True, True, False]
    assert "K read from 1x20x64 through reshape" in built.report.attention[0].line()
    arrays = [rng.standard_normal(s).astype("float32") for s in ((1, 20, 128), (1, 20, 64), (1, 20, 64))]
    angles = np.arange(20)[:, None] * rng.uniform(0.1, 1.0, 16)[None, :]
    tables = [f(np.concatenate([angles, angles], -1))[None].astype("float32") for f in (np.cos, np.sin)]
    got = relax.VirtualMachine(built.executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in arrays + tables]).numpy()
    assert _rel_error(got, _rotary_reference(*arrays, *tables, 4, 2, 32)) < 1e-4


def test_cuda_kernel_with_a_rotary_embedding_matches_under_simt_on_pocl():
    view = OperandView((1, 20, 64), (("reshape", (1, 20, 64), (1, 20, 2, 32)),
                                     ("permute", (1, 20, 2, 32), (0, 2, 1, 3))))
    rotary = dataclasses.replace(view, cos=(1, 20, 32), sin=(1, 20, 32), table_dtype="float32")
    shape = AttentionShape(1, 2, 2, 20, 20, 32, "float32", 0.125, "causal", operands=(rotary, rotary, view))
    result = attention_simt(shape, oclgrind=False)
    assert result.ok, result.detail


def test_rotary_chain_is_one_cuda_launch_moving_its_inputs_once():
    built = build(_rotary_module(64, 8, 2, 64), CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    modeled, _ = program_traffic(built.lowered, CUDA)
    inputs = 64 * (8 + 2 + 2) * 64 * 4 + 2 * 64 * 64 * 4  # the three projections and the cos and sin tables
    out = 8 * 64 * 64 * 4
    assert abs(modeled - inputs - out) <= 0.1 * (inputs + out)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("module", [_head_split_module(1, 512, 12, 64, False), _rotary_module(512, 32, 8, 128)],
                         ids=["head_split", "rotary"])
def test_prologue_kernels_compile_with_nvcc_without_spills(module, tmp_path):
    built = build(module, CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    report = nvcc(cuda_source(built.executable), tmp_path, arch="sm_90")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


def test_a_rotation_other_than_rotate_half_is_not_absorbed():
    """concat(x[..., :half], -x[..., half:]) is not LLaMA's rotate_half: Q stays a tensor of its own."""
    x, c, s = tensor("x", (1, 2, 8, 16), "float32"), tensor("c", (8, 16), "float32"), tensor("s", (8, 16), "float32")

    def body(bb, x, c, s):
        low, high = (bb.emit(op.strided_slice(x, [3], [b], [e])) for b, e in ((0, 8), (8, 16)))
        rot = bb.emit(op.concat([low, bb.emit(op.negative(high))], axis=-1))
        q = bb.emit(op.add(bb.emit(op.multiply(x, c)), bb.emit(op.multiply(rot, s))))
        scores = bb.emit(op.matmul(q, op.permute_dims(x, [0, 1, 3, 2])))
        return bb.emit(op.matmul(bb.emit(op.nn.softmax(scores, axis=-1)), x))

    chain = find_chains(function([x, c, s], body)["main"])[0][0]
    assert [view.cos for view in chain.views] == [(), (), ()] and chain.tables == ()
    assert chain.sources[0].same_as(chain.q) and chain.sources[1].same_as(x)
