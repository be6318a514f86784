"""Fused attention under symbolic sequence lengths: one kernel built once, run at several lengths (llvm
against numpy float64, the SIMT checker, nvcc), masks computed from the length proved causal or empty,
and the reason where a symbolic chain cannot fuse."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.relax import op

from conftest import attention_simt, needs_nvcc, nvcc
from tvm_stitch.analysis.attention_chain import find_chains
from tvm_stitch.analysis.attention_operand import OperandView, reshape_groups, source_index
from tvm_stitch.planning.attention import AttentionShape
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches, cuda_source, program_traffic
from tvm_stitch.tools.workloads.attention import Chain
from tvm_stitch.tools.workloads.relax_blocks import function, tensor

CUDA = {"kind": "cuda", "arch": "sm_90"}
N, M = tirx.Var("n", "int64"), tirx.Var("m", "int64")


def _rel_error(got, want) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("chain, lengths", [
    (Chain(2, 4, 80, 80, 32, kv_heads=2, symbolic=True), [(1, 1), (37, 37), (80, 80)]),
    (Chain(1, 2, 40, 72, 64, mask="additive", form="4d", symbolic=True), [(1, 3), (17, 50), (40, 72)]),
], ids=["gqa-self", "cross-padding-mask"])
def test_symbolic_chain_is_one_kernel_matching_numpy_at_three_lengths_on_llvm(chain, lengths, rng):
    built = build(chain.module(), host_target(), stitched=True)
    prims = [gv.name_hint for gv, f in built.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert [name for name in prims if name != "shape_func"] == ["fused_attention"]  # shape_func: the host's
    plan = built.report.attention[0].plan
    assert dict(plan.shape.priced_at) == ({"n": 80} if chain.q_len == chain.kv_len else {"n": 40, "m": 72})
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    for q_len, kv_len in lengths:  # a length of one tile, one of several with a ragged last tile, the bound
        arrays = chain.inputs(rng, q_len, kv_len)
        got = vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()
        assert _rel_error(got, chain.reference(arrays)) < 1e-4, (q_len, kv_len)


def test_symbolic_chain_is_one_cuda_launch_priced_at_its_bound():
    """float16 (in float32 TVM's default path is modeled faster at n = 256: 24.3 vs 37.9 us, and is kept)."""
    chain = Chain(2, 4, 256, 256, 64, "float16", kv_heads=2, mask="additive", symbolic=True)
    built = build(chain.module(), CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    record = built.report.attention[0]
    assert "q n x kv n (symbolic, planned at n=256)" in record.line() and "blocks x" in record.line()
    modeled, _ = program_traffic(built.lowered, CUDA)
    qkvo = sum(int(np.prod(s)) for s in chain.shapes()[:3]) * 2 + int(np.prod(chain.shapes()[0])) * 2
    mask = int(np.prod(chain.shapes()[3])) * 2
    assert abs(modeled - qkvo - mask) <= 0.1 * qkvo


def _causal_module(offset: int):
    """Scores of (1, 2, n, n) masked by where(j <= i + offset, 0, min) built from arange(0, n) in the
    graph (a decoder's mask under a symbolic length), softmax, P V."""
    q, k, v = (tensor(name, (1, 2, N, 16), "float32") for name in "qkv")

    def body(bb, q, k, v):
        pos = bb.emit(op.arange(0, N, 1, "int64"))
        rows = bb.emit(op.add(bb.emit(op.expand_dims(pos, [1])), relax.const(offset, "int64")))
        seen = bb.emit(op.less_equal(bb.emit(op.expand_dims(pos, [0])), rows))
        mask = bb.emit(op.where(seen, relax.const(0.0, "float32"), relax.const(-3.4e38, "float32")))
        scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])), relax.const(0.25, "float32")))
        p = bb.emit(op.nn.softmax(bb.emit(op.add(scores, bb.emit(op.expand_dims(mask, [0, 1])))), axis=-1))
        return bb.emit(op.matmul(p, v))

    return function([q, k, v], body)


@pytest.mark.parametrize("offset, kind", [(0, "causal"), (1, "additive")], ids=["causal", "shifted"])
def test_mask_from_a_symbolic_length_is_proved_causal_or_read(offset, kind, rng):
    """j <= i is causal (computed from the indices, the mask's bindings dropped); j <= i + 1 is not: read."""
    built = build(_causal_module(offset), host_target(), stitched=True)
    assert [r.plan.shape.mask for r in built.report.attention] == [kind]
    n = 21
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype("float32") for _ in range(3))
    got = relax.VirtualMachine(built.executable, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in (q, k, v)])
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    scores = np.where(j <= i + offset, 0.25 * q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2),
                      -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    assert _rel_error(got.numpy(), (p / p.sum(-1, keepdims=True)) @ v) < 1e-4


def test_symbolic_head_dimension_falls_back_with_reason():
    d = tirx.Var("d", "int64")
    q, k, v = (tensor(name, (1, 2, 8, d), "float32") for name in "qkv")

    def body(bb, q, k, v):
        p = bb.emit(op.nn.softmax(bb.emit(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2]))), axis=-1))
        return bb.emit(op.matmul(p, v))

    chains, others = find_chains(function([q, k, v], body)["main"])
    assert not chains and [o.code for o in others] == ["attention-symbolic-dims"]


def test_symbolic_reshape_views_map_to_numpy_views():
    """GPT-2's head split under a symbolic length: (2 s, 192) -> (2, s, 192) -> slice -> heads, by axis groups."""
    assert reshape_groups((2, N, 192), (N * 2, 192)) == [((0, 2), (0, 1)), ((2, 3), (1, 2))]
    assert reshape_groups((N, 3), (M, 3)) is None  # nothing proves n == m
    view = OperandView((N * 2, 192), (("reshape", (N * 2, 192), (2, N, 192)), ("slice", (2, N, 192), (2, 64, 1)),
                                      ("reshape", (2, N, 64), (2, N, 4, 16)), ("permute", (2, N, 4, 16), (0, 2, 1, 3))))
    n, index = 5, [tirx.Var(f"i{a}", "int64") for a in range(4)]
    x = np.arange(2 * n * 192).reshape(2 * n, 192)
    want = x.reshape(2, n, 192)[:, :, 64:128].reshape(2, n, 4, 16).transpose(0, 2, 1, 3)
    exprs = source_index(view, index)
    for point in np.ndindex(want.shape):
        analyzer = tvm.sym.Analyzer()
        for var, value in [(N, n), *zip(index, point)]:
            analyzer.bind(var, tirx.IntImm("int64", value))
        assert x[tuple(int(analyzer.simplify(e)) for e in exprs)] == want[point]


SIMT_CASES = [
    # causal GQA self-attention at a length of 20 (query tile 32 ragged) and 45 (two query tiles, ragged)
    (AttentionShape(1, 2, 1, N, N, 32, "float32", 0.125, "causal", priced_at=(("n", 32),)), [{"n": 20}, {"n": 45}]),
    # cross-attention with a padding mask, both lengths symbolic
    (AttentionShape(1, 2, 2, N, M, 32, "float32", 0.2, "additive", (1, 1, 1, M), "float32",
                    priced_at=(("n", 64), ("m", 128))), [{"n": 17, "m": 50}, {"n": 33, "m": 96}]),
]


def test_symbolic_cuda_kernel_matches_under_simt_on_pocl_at_two_lengths():
    shape, points = SIMT_CASES[0]
    result = attention_simt(shape, oclgrind=False, points=points)
    assert result.ok and result.sizes == ("n=20", "n=45"), result.detail


@pytest.mark.slow
@pytest.mark.parametrize("shape, points", SIMT_CASES, ids=["causal-gqa", "cross-padding"])
def test_symbolic_cuda_kernel_is_clean_under_oclgrind_at_two_lengths(shape, points):
    result = attention_simt(shape, oclgrind=True, points=points)
    assert result.ok, result.detail


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("chain", [Chain(2, 12, 512, 512, 64, symbolic=True),
                                   Chain(1, 32, 1024, 1024, 128, "float16", kv_heads=8, mask="additive",
                                         symbolic=True),
                                   Chain(1, 12, 128, 2048, 64, "float16", form="4d", symbolic=True)], ids=str)
def test_symbolic_kernels_compile_with_nvcc_without_spills(chain, tmp_path):
    built = build(chain.module(), CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    report = nvcc(cuda_source(built.executable), tmp_path, arch="sm_90")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
