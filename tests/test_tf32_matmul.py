"""float32 GEMMs on TF32 tensor cores with `allow_tf32=True` (schedules/mma_tf32_intrinsics.py): nvcc for
sm_80 and sm_90 finds mma.sync m16n8k8 .tf32 in every such kernel's PTX and ptxas no spill; the time
model prices them on the tf32_tc unit; the SIMT checker runs the tensorized kernel; without the option float32 CUDA source is byte for byte what it
was; the torch.compile backend passes the option on."""

import hashlib
import re

import numpy as np
import pytest
import tvm

from schedules import mma_tf32_intrinsics as tf32
from schedules.cuda import tensor_core_matmul
from schedules.tensorize_guard import tensorize_faults
from tvm_stitch.simt.simt_inputs import concrete_shape
from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.tools.module_time import stitched_module_time
from tvm_stitch.torch.dynamo_backend import Options, _compile

from conftest import needs_nvcc, nvcc
from mma_gemm import gemm
from tir_text import run_on_pocl, with_static_shared
from test_tensor_core_matmul import GEMMS, gemm_module, gemm_reference, kernel_rules, spills, untimed  # noqa: F401 - a fixture

TF32_MMA = r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32"
# TF32 keeps 10 of float32's 23 mantissa bits: each product's operands within 2^-10 relative
TF32_RTOL = 2.0 ** -9


def _cuda(arch: str) -> dict:
    return {"kind": "cuda", "arch": arch}


def _sha(built) -> str:
    return hashlib.sha256(cuda_source(built.executable).encode()).hexdigest()


# every GEMM on sm_90, two on sm_80 in the quick tier
TARGETS = [(name, "sm_90") for name in GEMMS] + [("square", "sm_80"), ("weight-gradient", "sm_80")] + [
    pytest.param(name, "sm_80", marks=pytest.mark.slow) for name in ("small", "padded", "scores")]


@needs_nvcc
@pytest.mark.parametrize("name,arch", TARGETS)
def test_float32_gemms_run_on_tf32_tensor_cores_without_spills(name, arch, tmp_path, untimed):
    built = build(gemm_module(name, "float32"), _cuda(arch), stitched=True, allow_tf32=True)
    assert list(kernel_rules(built).values()) == [TENSOR_CORE_RULE]
    source = cuda_source(built.executable)
    nvcc(source, tmp_path, arch=arch, ptx=True)
    assert len(re.findall(TF32_MMA, (tmp_path / "kernels.ptx").read_text())) > 0
    assert spills(nvcc(source, tmp_path, arch=arch)) == []


@needs_nvcc
@pytest.mark.parametrize("name", ["square", "weight-gradient"])
def test_without_allow_tf32_float32_source_does_not_change(name):
    """Off (the default, or said), a float32 GEMM keeps dlight's SIMT Matmul: the same CUDA source, no mma."""
    module = gemm_module(name, "float32")
    default = build(module, _cuda("sm_90"), stitched=True)
    off = build(module, _cuda("sm_90"), stitched=True, allow_tf32=False)
    on = build(module, _cuda("sm_90"), stitched=True, allow_tf32=True)
    assert _sha(default) == _sha(off) != _sha(on)
    assert "mma" not in cuda_source(off.executable) and TENSOR_CORE_RULE not in kernel_rules(off).values()


def test_half_gemms_do_not_change_with_allow_tf32():
    module = gemm_module("square", "bfloat16")
    assert _sha(build(module, _cuda("sm_90"), stitched=True)) == _sha(
        build(module, _cuda("sm_90"), stitched=True, allow_tf32=True))


@pytest.mark.parametrize("name", list(GEMMS))
def test_the_same_gemms_match_numpy_on_llvm_within_tf32(name, rng):
    a_shape, b_shape, _, _ = GEMMS[name]
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    (out,) = run_cpu(build(gemm_module(name, "float32"), host_target(), stitched=True, allow_tf32=True).executable,
                     [a, b])
    expected = gemm_reference(name, a, b)
    depth = a_shape[-1] if not GEMMS[name][2] else a_shape[0]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=TF32_RTOL,
                               atol=TF32_RTOL * np.sqrt(depth) * np.abs(expected).max())


def test_before_sm_80_tf32_falls_back_to_dlight():
    built = build(gemm_module("square", "float32"), _cuda("sm_75"), stitched=True, allow_tf32=True)
    assert set(kernel_rules(built).values()) == {"Matmul"}
    assert "mma.sync" not in cuda_source(built.executable)


def test_the_arch_says_whether_its_mma_takes_tf32():
    specs = {arch: TargetSpec.from_target(tvm.target.Target(_cuda(arch))) for arch in ("sm_75", "sm_80", "sm_90")}
    assert (specs["sm_75"].mma_tf32, specs["sm_80"].mma_tf32, specs["sm_90"].mma_tf32) == (False, True, True)


def test_the_time_model_prices_a_tf32_gemm_on_the_tf32_tensor_cores():
    m, n, k = GEMMS["square"][0][0], GEMMS["square"][1][1], GEMMS["square"][0][1]
    spec = TargetSpec.from_target(tvm.target.Target(_cuda("sm_90")))
    (_, _, (t,)), = stitched_module_time(gemm_module("square", "float32"), _cuda("sm_90"), spec,
                                         allow_tf32=True).kernels
    per_thread = 2.0 * m * n * k / (t.geometry.grid * t.geometry.threads)
    assert dict(t.geometry.flops).get("tf32_tc") == pytest.approx(per_thread)
    assert t.us >= 2.0 * m * n * k / spec.tf32_tc_flops_per_us
    (_, _, (exact,)), = stitched_module_time(gemm_module("square", "float32"), _cuda("sm_90"), spec).kernels
    assert "tf32_tc" not in dict(exact.geometry.flops) and dict(exact.geometry.flops).get("fp32", 0) > 0


def test_fragment_layouts_cover_each_lane_and_element_once():
    """The A and B layouts of the TF32 tile place the 256 entries on 32 lanes x 8 elements, one each."""
    for index in (tf32.fragment_index_a, tf32.fragment_index_b):
        cells = {index(r, c) for r in range(tf32.TILE) for c in range(tf32.TILE)}
        assert cells == {(lane, e) for lane in range(tf32.LANES) for e in range(tf32.ELEMENTS)}


def test_the_backend_passes_allow_tf32_on():
    assert Options().allow_tf32 is False
    with pytest.raises(TypeError, match="allow_tf32"):
        Options(allow_tf32="yes")
    assert Options(allow_tf32=True).build_options() != Options().build_options()
    assert Options().build_options() == (None, False, None, Options().fusion)  # keys without it as before
    target = tvm.target.Target(_cuda("sm_90"))
    executable = _compile(gemm_module("square", "float32"), target, Options(target=target, allow_tf32=True))
    assert "tf32" in cuda_source(executable)


@pytest.mark.skipif(tensorize_faults(), reason="TVM's Tensorize faults with this tvm-ffi")
@pytest.mark.parametrize("b_transposed", [True, False])
def test_the_tf32_gemm_matches_numpy_under_the_simt_checker(b_transposed):
    """The tensorized float32 GEMM (64 x 48 x 96) run on pocl with ldmatrix and mma.sync m16n8k8 emulated
    lane by lane: within TF32's tolerance of numpy, and within float32 rounding of the product of the
    operands truncated to TF32 (what the tensor cores read)."""
    spec = TargetSpec.from_target(tvm.target.Target(_cuda("sm_90")))
    func = with_static_shared(tensor_core_matmul.apply(gemm(64, 48, 96, b_transposed, "float32", "float32"), spec,
                                                       allow_tf32=True).mod["main"])
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(-1, 1, concrete_shape(p)).astype(np.float32) for p in func.params[:2])
    result = run_on_pocl(func, {0: a, 1: b})
    assert not result.guard_problems

    def product(x, y):
        x, y = x.astype(np.float64), y.astype(np.float64)
        return x @ (y.T if b_transposed else y)

    def truncated(x):
        return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    got = result.outputs[2]
    np.testing.assert_allclose(got, product(truncated(a), truncated(b)), atol=1e-5 * 96)
    assert np.abs(got - product(a, b)).max() <= TF32_RTOL * 96
    assert np.abs(got - product(a, b)).max() > 1e-5  # the products are TF32's, not float32's
