"""The tensor-core attention kernel with its key tiles split over warps (plan.kv_splits): chosen by the time
model where too few query tiles leave SMs idle (cross-attention of 128 queries), the warps' (max, sum, output)
combined through shared memory, matching the unfused computation under the SIMT checker (causal, GQA, masks,
symbolic lengths) and compiling without spills."""

from __future__ import annotations

import dataclasses
import re

import pytest
import tvm
from tvm import tirx

from conftest import needs_nvcc, nvcc, opencl_device
from attention_reference import reference_func
from tvm_stitch.planning import attention_mma
from tvm_stitch.planning.attention import AttentionPlan, AttentionShape, plan_attention
from tvm_stitch.planning.attention_cost import modeled_us
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.attention_default import default_floor_us, default_us
from tvm_stitch.rewrites.attention import kernel_for
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches
from tvm_stitch.tools.workloads.attention import Chain

SM90 = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
N, M = tirx.Var("n", "int64"), tirx.Var("m", "int64")


def _shape(batch, heads, q_len, kv_len, head_dim, dtype, kv_heads=None, mask="none", priced_at=()):
    mask_shape = (batch, 1, 1, kv_len) if mask == "additive" else ()
    return AttentionShape(batch, heads, kv_heads or heads, q_len, kv_len, head_dim, dtype, head_dim ** -0.5, mask,
                          mask_shape, "float32" if mask_shape else "", priced_at=priced_at)


def _split(shape, q_tile, kv_splits, warp_keys):
    return AttentionPlan(shape, SM90, q_tile=q_tile, k_tile=kv_splits * warp_keys, mma=True, kv_splits=kv_splits)


def _flops(shape) -> float:
    return 4.0 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cross_attention_of_few_queries_plans_a_key_split_the_model_prices_faster(dtype):
    shape = _shape(1, 12, 128, 2048, 64, dtype)
    plan = plan_attention(shape, SM90)
    unsplit = [p for p in attention_mma.candidates(shape, SM90, AttentionPlan) if p.kv_splits == 1]
    assert plan.mma and plan.kv_splits > 1 and plan.threads == plan.q_tile // 16 * plan.kv_splits * 32
    assert "split over" in plan.describe()
    best_unsplit = min(modeled_us(p) for p in unsplit)
    assert modeled_us(plan) < 0.7 * best_unsplit
    assert _flops(shape) / modeled_us(plan) / 1e6 > 1.5 * _flops(shape) / best_unsplit / 1e6


@pytest.mark.parametrize("case", [dict(batch=2, heads=16, q_len=1024, kv_len=1024, head_dim=64),
                                  dict(batch=8, heads=12, q_len=512, kv_len=512, head_dim=64, mask="additive")])
def test_enough_query_tiles_keep_one_warp_per_key_tile(case):
    assert plan_attention(_shape(**case, dtype="float16"), SM90).kv_splits == 1


@pytest.mark.parametrize("head_dim, splits", [(64, {1, 2, 4, 8}), (128, {1, 2, 4})])
def test_split_plans_fit_shared_memory_and_registers(head_dim, splits):
    """At head dim 128 a tile of 8 warps x 16 keys (K and V: 69 KB) exceeds the 48 KB of static shared memory."""
    shape = _shape(1, 32, 2048, 2048, head_dim, "bfloat16", kv_heads=8, mask="causal")
    plans = attention_mma.candidates(shape, SM90, AttentionPlan)
    assert {p.kv_splits for p in plans} == splits
    for p in plans:
        assert p.shared_bytes() <= SM90.shared_bytes_per_block and p.threads <= SM90.max_threads_per_block
        assert attention_mma.registers(head_dim, p.k_tile // p.kv_splits) * p.threads <= SM90.registers_per_sm


def _check(plan, oclgrind=False, points=None):
    ref = reference_func(plan.shape)
    return check_kernel("fused_attention", kernel_for(plan), [Reference(ref, tuple(range(len(ref.params))))],
                        opencl_device(oclgrind), oclgrind, 0, points or [{}])


def test_split_cross_attention_matches_reference_on_pocl():
    """4 warps of 16 keys on one 16-row query tile; 200 keys: the last key tile ragged."""
    check = _check(_split(_shape(1, 1, 16, 200, 64, "float16"), 16, 4, 16))
    assert check.ok and "emulated lane by lane" in check.detail, check


def test_split_padding_mask_over_two_row_groups_matches_on_pocl():
    """Query tile 32 (two 16-row groups) x 2 splits of 32 keys, a padding mask, ragged query and key tiles."""
    check = _check(_split(_shape(2, 1, 50, 100, 64, "bfloat16", mask="additive"), 32, 2, 32))
    assert check.ok, check


@pytest.mark.slow
def test_split_causal_gqa_head_dim_128_matches_on_pocl():
    """Causal: the warps past the diagonal see no key of a tile (their weight is 0 in the combine)."""
    check = _check(_split(_shape(1, 2, 48, 80, 128, "float16", kv_heads=1, mask="causal"), 16, 4, 16))
    assert check.ok, check


@pytest.mark.slow
def test_split_symbolic_lengths_match_on_pocl():
    shape = _shape(1, 2, N, M, 64, "float16", mask="additive", priced_at=(("n", 64), ("m", 128)))
    shape = dataclasses.replace(shape, mask_shape=(1, 1, 1, M))
    check = _check(_split(shape, 16, 4, 16), points=[{"n": 17, "m": 50}, {"n": 33, "m": 96}])
    assert check.ok and len(check.sizes) == 2, check


@pytest.mark.slow
def test_split_kernel_is_clean_under_oclgrind():
    check = _check(_split(_shape(1, 1, 16, 40, 16, "float16"), 16, 2, 16), oclgrind=True)
    assert check.ok, check


@needs_nvcc
@pytest.mark.parametrize("shape, split", [
    (_shape(1, 12, 128, 2048, 64, "float16"), (16, 8, 16)),
    (_shape(1, 32, 2048, 2048, 128, "bfloat16", kv_heads=8, mask="causal"), (16, 4, 16)),
], ids=["cross", "causal-gqa-128"])
def test_split_kernels_compile_without_spills_on_sm80_and_sm90(shape, split, tmp_path):
    func = kernel_for(_split(shape, *split)).with_attr("global_symbol", "main")
    source = tvm.tirx.build(tvm.IRModule({"main": func}), target=tvm.target.Target(
        {"kind": "cuda", "arch": "sm_90"})).imports[0].inspect_source("")
    assert "mma.sync.aligned.m16n8k16" in source and "__launch_bounds__(" in source
    for arch in ("sm_80", "sm_90"):
        report = nvcc(source, tmp_path, arch=arch)
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report


@pytest.mark.parametrize("dtype, fused", [("float16", True), ("float32", False)])
def test_fusion_follows_the_modeled_prices_of_both_paths(dtype, fused):
    """Cross-attention 128 x 2048: on tensor cores the fused kernel is modeled faster than TVM's default path
    (two batched matmuls around a softmax); in float32 (FMA kernel, 24 blocks) the default's tensor-core-free
    matmuls are modeled faster, and the chain keeps TVM's path with the two prices in the report."""
    chain = Chain(1, 12, 128, 2048, 64, dtype, form="4d")
    built = build(chain.module(), {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    [record] = built.report.attention
    shape = _shape(1, 12, 128, 2048, 64, dtype)
    fused_us = modeled_us(plan_attention(shape, SM90))
    default = default_us(shape, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), SM90)
    assert record.fused == fused == (fused_us < default)
    if fused:  # priced against the default's floor (below its modeled time) or its modeled time
        assert fused_us < record.default_us <= default + 1e-6 and "TVM's default path" in record.line()
        assert count_launches(built.lowered, built.executable) == 1
    else:
        assert record.reason.code == "attention-default-faster" and count_launches(built.lowered, built.executable) > 1
        assert f"{round(default, 1)} us" in record.line()


@pytest.mark.parametrize("shape", [_shape(1, 12, 128, 2048, 64, "float32"), _shape(1, 12, 128, 2048, 64, "float16"),
                                   _shape(2, 12, 512, 512, 64, "float32"), _shape(1, 4, 64, 64, 64, "float16",
                                                                                   kv_heads=2, mask="causal")], ids=str)
def test_the_default_paths_floor_is_below_its_modeled_time(shape):
    """A fused kernel faster than the floor is fused without lowering the default path: the floor must not
    exceed the default's modeled time."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert 0 < default_floor_us(shape, SM90) <= default_us(shape, target, SM90)
