"""float16/bfloat16 GEMMs on tensor cores (schedules/cuda/tensor_core_matmul.py): nvcc for sm_80 and
sm_90 finds the mma.sync instructions of the operand dtype in every such GEMM's kernel, and ptxas no
spill; the llvm builds of the same graphs match numpy; float32 GEMMs keep dlight's exact schedule."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from schedules.cuda import tensor_core_matmul
from tvm_stitch.analysis.classify import TENSOR_CORE_RULE
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import cuda_source, primfunc_calls

from tvm_stitch.target import host_target

from conftest import make_module, needs_nvcc, nvcc, tensor

op = relax.op
HALF = ("bfloat16", "float16")
PTX_TYPE = {"bfloat16": "bf16", "float16": "f16"}
BF16_RTOL = 2e-2  # a float32 accumulation of bfloat16 products, rounded once to bfloat16 (8 bits)

# name: (shape of a, shape of b, a is stored [k, m], b is stored [n, k])
GEMMS = {
    "square": ((256, 256), (256, 256), False, False),
    "small": ((16, 64), (64, 32), False, False),  # every extent 64 or less: dlight leaves it to FMA
    "padded": ((40, 72), (72, 24), False, False),  # no extent a multiple of 16
    "scores": ((2, 4, 16, 16), (2, 4, 16, 16), False, True),  # Q K^T of 4 heads of 16
    "weight-gradient": ((64, 128), (64, 96), True, False),  # X^T dY
}


def gemm_module(name: str, dtype: str) -> tvm.IRModule:
    """The importer's form of a product: matmul with a float32 accumulator, cast to `dtype`."""
    a_shape, b_shape, trans_a, trans_b = GEMMS[name]

    def body(bb, a, b):
        if trans_a:
            a = bb.emit(op.permute_dims(a, [1, 0]))
        if trans_b:
            b = bb.emit(op.permute_dims(b, [0, 1, 3, 2]))
        product = bb.emit(op.matmul(a, b, out_dtype="float32"))
        return bb.emit(op.astype(product, dtype) if dtype != "float32" else product)

    return make_module([tensor("a", a_shape, dtype), tensor("b", b_shape, dtype)], body)


def gemm_reference(name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    _, _, trans_a, trans_b = GEMMS[name]
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a.T if trans_a else a) @ (np.swapaxes(b, -1, -2) if trans_b else b)


def kernel_rules(built) -> dict:
    """Schedule rule per called PrimFunc of a CUDA build."""
    return {name: str(built.lowered[name].attrs.get("tvm_stitch.schedule_rule", "stitched"))
            for name in primfunc_calls(built.lowered)}


def mma_per_kernel(ptx: str, dtype: str) -> dict:
    """Count of `mma.sync.aligned.m16n8k16.row.col.f32.<dtype>.<dtype>.f32` per PTX entry."""
    ptx_type = PTX_TYPE[dtype]
    pattern = rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ptx_type}\.{ptx_type}\.f32"
    entries = re.split(r"\.entry\s+", ptx)[1:]
    return {entry.split("(")[0].strip(): len(re.findall(pattern, entry)) for entry in entries}


def spills(ptxas_report: str) -> list:
    """(kernel, spill store bytes, spill load bytes) of each kernel that spills."""
    found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
                       ptxas_report, re.S)
    return [entry for entry in found if entry[1] != "0" or entry[2] != "0"]


def check_tensor_cores(built, dtype: str, arch: str, tmp_path) -> dict:
    """Assert every GEMM kernel of `built` is scheduled on tensor cores with the mma of `dtype` in its
    PTX and that no kernel spills; returns the mma count per tensorized kernel."""
    source = cuda_source(built.executable)
    nvcc(source, tmp_path, arch=arch, ptx=True)
    mmas = mma_per_kernel((tmp_path / "kernels.ptx").read_text(), dtype)
    assert spills(nvcc(source, tmp_path, arch=arch)) == []
    counts = {}
    for name, rule in kernel_rules(built).items():
        if rule == TENSOR_CORE_RULE:
            counts[name] = sum(n for entry, n in mmas.items() if entry.startswith(f"{name}_kernel"))
            assert counts[name] > 0, name
    return counts


@pytest.fixture
def untimed(monkeypatch):
    """The pipeline keeps every GEMM's tensor-core schedule, whatever the time model says of dlight's
    (pricing/gemm_choice.py): the schedule's PTX is checked here, not the choice."""
    import importlib

    from tvm_stitch.pricing.gemm_choice import GemmChoice, scheduled

    pipeline = importlib.import_module("tvm_stitch.pipeline")  # the module: the package exports its function
    monkeypatch.setattr(pipeline, "faster_gemm", lambda func, tensor_core, target, spec, name="": (
        scheduled(tensor_core, TENSOR_CORE_RULE), GemmChoice(name, TENSOR_CORE_RULE, -1.0, -1.0)))


# (dtype, arch): every dtype and every arch in the quick tier, the other pairs in the slow one
TARGETS = [("bfloat16", "sm_90"), ("float16", "sm_80"),
           pytest.param("bfloat16", "sm_80", marks=pytest.mark.slow),
           pytest.param("float16", "sm_90", marks=pytest.mark.slow)]


@needs_nvcc
@pytest.mark.parametrize("dtype,arch", TARGETS)
@pytest.mark.parametrize("name", list(GEMMS))
def test_half_gemms_run_on_tensor_cores_without_spills(name, dtype, arch, tmp_path, untimed):
    built = build(gemm_module(name, dtype), {"kind": "cuda", "arch": arch}, stitched=True)
    counts = check_tensor_cores(built, dtype, arch, tmp_path)
    assert len(counts) == 1, kernel_rules(built)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(GEMMS))
def test_the_same_gemms_match_numpy_on_llvm(name, dtype, rng):
    import ml_dtypes

    a_shape, b_shape, _, _ = GEMMS[name]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    a = rng.standard_normal(a_shape).astype(np_dtype)
    b = rng.standard_normal(b_shape).astype(np_dtype)
    (out,) = run_cpu(build(gemm_module(name, dtype), host_target(), stitched=True).executable, [a, b])
    expected = gemm_reference(name, a, b)
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, rtol=BF16_RTOL,
                               atol=BF16_RTOL * np.abs(expected).max())


@needs_nvcc
def test_float32_gemms_keep_the_exact_schedule(tmp_path):
    """A float32 GEMM is no tensor-core GEMM: dlight's SIMT Matmul, no mma in its CUDA source."""
    built = build(gemm_module("square", "float32"), {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert set(kernel_rules(built).values()) == {"Matmul"}
    assert "mma" not in cuda_source(built.executable)


def test_before_sm_80_bfloat16_falls_back_to_dlight():
    """sm_75 has no bfloat16 mma: the rule declines and dlight's Matmul schedules the GEMM."""
    built = build(gemm_module("square", "bfloat16"), {"kind": "cuda", "arch": "sm_75"}, stitched=True)
    assert set(kernel_rules(built).values()) == {"Matmul"}
    assert "mma.sync" not in cuda_source(built.executable)


def test_mma_dtypes_follow_the_arch():
    spec = {arch: TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": arch}))
            for arch in ("sm_75", "sm_80", "sm_90")}
    assert spec["sm_75"].mma_dtypes == ()
    assert spec["sm_80"].mma_dtypes == spec["sm_90"].mma_dtypes == ("float16", "bfloat16")


@pytest.mark.parametrize("extents,warps,fragments", [
    ((16, 16, 16), (1, 1), (1, 1)),
    ((64, 64, 64), (2, 2), (1, 1)),  # one block of 64 x 64 split four ways: more SMs busy
    ((512, 1376, 512), (2, 2), (4, 1)),  # 1376 = 43 x 32: no padding
    ((512, 512, 512), (2, 2), (1, 2)),  # 128 blocks of 32 x 64 on 132 SMs (sm_90)
    ((48, 32, 64), (1, 2), (3, 1)),
    ((4096, 4096, 4096), (2, 2), (4, 2)),
    ((None, 64, None), (2, 2), (4, 2)),
])
def test_the_tile_fits_small_extents(extents, warps, fragments):
    """Extents of 64 or less get a block tile of their size rounded up to 16, not the large one; a tile
    that divides an extent is preferred to one that pads it, and small GEMMs get one block per SM."""
    spec = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    tile = tensor_core_matmul.choose_tile(extents, spec, 2)
    assert (tile.warps, tile.fragments) == (warps, fragments)
    assert tile.shared_bytes(2) <= spec.shared_bytes_per_block


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", HALF)
def test_every_gemm_of_a_half_model_runs_on_tensor_cores(model, dtype, tmp_path, untimed):
    """The LLaMA and GPT-2 block stacks (test size) forward: every compute kernel left to the GEMM rules
    (projections, MLP, attention scores and P V) is tensorized, mma in its PTX, no spill."""
    from tvm_stitch.analysis.classify import is_compute_kernel
    from tvm_stitch.tools.models import import_model

    mod, _, _ = import_model(model, "test", dtype=dtype)
    built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    gemms = [name for name, rule in kernel_rules(built).items()
             if rule != "stitched" and is_compute_kernel(built.lowered[name])]
    counts = check_tensor_cores(built, dtype, "sm_90", tmp_path)
    assert gemms and set(gemms) == set(counts), kernel_rules(built)
