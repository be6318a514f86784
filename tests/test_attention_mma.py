"""The attention kernel on tensor cores (schedules/cuda/attention_mma.py): planned for float16 and bfloat16
on sm_80+, mma.sync in the PTX without spills, the SIMT checker through the emulated ldmatrix, mma and
shuffles against the unfused computation, a wrong fragment layout failing, and its modeled throughput."""

from __future__ import annotations

import re

import pytest
import tvm
import tvm_ffi

from conftest import needs_nvcc, nvcc, opencl_device
from attention_reference import reference_func
from tvm_stitch.planning.attention import AttentionShape, plan_attention
from tvm_stitch.planning.attention_cost import geometry, modeled_us, visited_fraction
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.rewrites.attention import kernel_for
from tvm_stitch.simt import ptx_fragments
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.workloads.attention import Chain

HALF = ("float16", "bfloat16")
SM90 = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))


def _shape(batch, heads, q_len, kv_len, head_dim, dtype, kv_heads=None, mask="none"):
    mask_shape = (batch, 1, 1, kv_len) if mask == "additive" else ()
    return AttentionShape(batch, heads, kv_heads or heads, q_len, kv_len, head_dim, dtype, head_dim ** -0.5, mask,
                          mask_shape, "float32" if mask_shape else "")


# The issue's shapes: (2, 16, 1024, 64); (8, 12, 512, 64) padding mask; (1, 32 over 8 KV heads, 2048, 128)
# causal; cross-attention 128 x 2048.
ISSUE = {
    "plain": dict(batch=2, heads=16, q_len=1024, kv_len=1024, head_dim=64),
    "padding": dict(batch=8, heads=12, q_len=512, kv_len=512, head_dim=64, mask="additive"),
    "causal-gqa": dict(batch=1, heads=32, q_len=2048, kv_len=2048, head_dim=128, kv_heads=8, mask="causal"),
    "cross": dict(batch=1, heads=12, q_len=128, kv_len=2048, head_dim=64),
}


def _mma_calls(func) -> list:
    found = []
    tvm_ffi.structural_walk(func, (tvm.ir.Expr, lambda e: found.append(e) if isinstance(e, tvm.ir.Call)
                                   and getattr(e.op, "name", "") == "tirx.ptx_legacy.mma" else None), order="pre")
    return found


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_plans_the_tensor_core_kernel_and_float32_keeps_fma(dtype):
    plan = plan_attention(_shape(**ISSUE["plain"], dtype=dtype), SM90)
    assert plan.mma and plan.threads == plan.q_tile // 16 * 32
    assert "mma.sync m16n8k16" in plan.describe()
    assert not plan_attention(_shape(**ISSUE["plain"], dtype="float32"), SM90).mma
    sm75 = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_75"}))
    assert not plan_attention(_shape(**ISSUE["plain"], dtype=dtype), sm75).mma
    mma = _mma_calls(kernel_for(plan))
    assert mma and {str(call.args[3].value) for call in mma} == {"fp16" if dtype == "float16" else "bf16"}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", ["plain", "padding"])
def test_modeled_throughput_on_sm90_is_within_tensor_core_range(case, dtype):
    plan = plan_attention(_shape(**ISSUE[case], dtype=dtype), SM90)
    s = plan.shape
    flops = 4.0 * s.batch * s.heads * s.q_len * s.kv_len * s.head_dim * visited_fraction(plan)
    tensor = dict(geometry(plan).flops)["fp16_tc" if dtype == "float16" else "bf16_tc"]
    assert tensor * plan.threads * plan.tasks == pytest.approx(flops)
    tflops = flops / modeled_us(plan) / 1e6
    assert 150 <= tflops <= 900, tflops
    fma = plan_attention(_shape(**ISSUE[case], dtype="float32"), SM90)
    assert modeled_us(plan) < modeled_us(fma)


@needs_nvcc
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", sorted(ISSUE))
def test_mma_in_the_ptx_without_spills_on_sm80_and_sm90(case, dtype, tmp_path):
    plan = plan_attention(_shape(**ISSUE[case], dtype=dtype), SM90)
    func = kernel_for(plan).with_attr("global_symbol", "main")
    source = tvm.tirx.build(tvm.IRModule({"main": func}), target=tvm.target.Target(
        {"kind": "cuda", "arch": "sm_90"})).imports[0].inspect_source("")
    ptx_type = "f16" if dtype == "float16" else "bf16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in source
    for arch in ("sm_80", "sm_90"):
        report = nvcc(source, tmp_path, arch=arch)
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 255


@pytest.mark.parametrize("dtype", HALF)
def test_half_chain_is_one_cuda_launch_on_tensor_cores(dtype):
    chain = Chain(1, 4, 64, 64, 64, dtype, kv_heads=2, mask="causal")
    built = build(chain.module(), {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1
    assert [r.plan.mma for r in built.report.attention] == [True]
    assert "mma.sync.aligned.m16n8k16" in cuda_source(built.executable)


SIMT = {
    "plain": dict(batch=1, heads=2, q_len=64, kv_len=128, head_dim=64),
    "padding, ragged": dict(batch=2, heads=1, q_len=50, kv_len=100, head_dim=64, mask="additive"),
    "causal gqa, head dim 128": dict(batch=1, heads=2, q_len=80, kv_len=80, head_dim=128, kv_heads=1,
                                     mask="causal"),
    "cross": dict(batch=1, heads=1, q_len=16, kv_len=200, head_dim=64),
}


def _check(shape, spec=SM90, oclgrind=False):
    plan = plan_attention(shape, spec)
    assert plan.mma
    ref = reference_func(shape)
    return check_kernel("fused_attention", kernel_for(plan), [Reference(ref, tuple(range(len(ref.params))))],
                        opencl_device(oclgrind), oclgrind, 0, [{}])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", ["plain", "padding, ragged"])
def test_tensor_core_kernel_matches_reference_on_pocl(case, dtype):
    check = _check(_shape(**SIMT[case], dtype=dtype))
    assert check.ok and "emulated lane by lane" in check.detail, check


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", ["causal gqa, head dim 128", "cross"])
def test_tensor_core_kernel_masks_and_heads_on_pocl(case, dtype):
    check = _check(_shape(**SIMT[case], dtype=dtype))
    assert check.ok, check


@pytest.mark.slow
def test_tensor_core_kernel_is_clean_under_oclgrind():
    """Head dim 16: the tiles, widened to float32 storage, and the emulation's exchange fit Oclgrind's 32 KB."""
    check = _check(_shape(1, 1, 16, 40, 16, "float16"), oclgrind=True)
    assert check.ok, check


def test_a_wrong_accumulator_layout_fails_the_attention_check(monkeypatch):
    true = ptx_fragments.mma_c
    monkeypatch.setattr(ptx_fragments, "mma_c", lambda lane, i: true({2: 3, 3: 2}.get(lane, lane), i))
    check = _check(_shape(**SIMT["plain"], dtype="float16"))
    assert check.status == "mismatch", check
