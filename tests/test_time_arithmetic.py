"""The time model's arithmetic: per-arch math rates, operations read from lowered kernels, GEMMs priced
by their arithmetic, and the model against published measurements (docs/time-model.md, "Checks against
published measurements")."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from conftest import CUDA, make_module, tensor
from tvm_stitch.planning.attention import AttentionShape, plan_cuda
from tvm_stitch.planning.attention_cost import geometry as attention_geometry
from tvm_stitch.pricing.arithmetic import add_arithmetic
from tvm_stitch.pricing.contraction import contraction_dram_bytes
from tvm_stitch.pricing.traffic import Traffic
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import KernelGeometry, kernel_time, math_rate, peak_bytes_per_us
from tvm_stitch.tools.module_time import comparison, stitched_module_time
from tvm_stitch.tools.workloads import SUITE, dims

op = relax.op
H200 = TargetSpec.from_target(CUDA)
N = 4096
GEMM_FLOPS = 2 * N ** 3
# Published: cuBLAS-class dense FP16 GEMMs at 4096^3 and above reach ~70-80% of the H100's dense
# tensor-core peak; memory-bound LayerNorm and softmax kernels ~85-90% of the peak bandwidth.
GEMM_SHARE = 0.75
NORM_SHARE = 0.875
# FlashAttention-2's forward on the H100 SXM5, head dim 128, 16K tokens, not causal: ~335 TFLOP/s
# (Shah et al., "FlashAttention-3", 2024, figure 5).
FA2_TFLOPS = 335.0


def _spec(arch: str) -> TargetSpec:
    return TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": arch}))


def _matmul(dtype: str, m: int = N, k: int = N, n: int = N) -> tvm.IRModule:
    x, w = tensor("x", (m, k), dtype), tensor("w", (k, n), dtype)
    return make_module([x, w], lambda bb, x, w: bb.emit(op.matmul(x, w)))


def _physical(t, spec: TargetSpec) -> bool:
    """No kernel faster than its bytes at the peak bandwidth or its operations at their units' peaks."""
    math_us = sum(ops * t.geometry.threads * t.geometry.grid / math_rate(spec, unit) for unit, ops in t.geometry.flops)
    return t.us >= t.bytes / peak_bytes_per_us(spec) and t.us >= math_us and t.math_fraction <= 1.0


def test_math_rates_of_the_data_sheets():
    assert H200.fp32_flops_per_us == pytest.approx(66.9e6) and H200.fp16_tc_flops_per_us == pytest.approx(989.4e6)
    assert H200.tf32_tc_flops_per_us == pytest.approx(494.7e6) and H200.int8_tc_flops_per_us == pytest.approx(1978.9e6)
    a100 = _spec("sm_80")
    assert (a100.fp32_flops_per_us, a100.bf16_tc_flops_per_us, a100.tf32_tc_flops_per_us) == pytest.approx(
        (19.5e6, 312e6, 156e6))
    volta = _spec("sm_70")
    assert volta.fp16_tc_flops_per_us == pytest.approx(125e6)
    # No BF16 on Volta: a bfloat16 mma or FMA runs as FP32 FMA (converted).
    assert math_rate(volta, "bf16_tc") == math_rate(volta, "bf16") == volta.fp32_flops_per_us


def test_mma_instructions_count_by_shape_and_dtype():
    a = tvm.tirx.Var("a", tvm.ir.PointerType(tvm.ir.PrimType("bfloat16")))
    mma = tvm.tirx.call_intrin("", "tirx.ptx_legacy.mma", "m16n8k16", "row", "col", "bf16", "bf16", "fp32",
                               a, 0, a, 0, a, 0, False)
    wmma = tvm.tirx.call_intrin("", "tirx.tvm_mma_sync", a, 0, a, 0, a, 0, a, 0)
    flops: dict = {}
    add_arithmetic(flops, mma, 3)  # 2 x 16 x 8 x 16 operations per warp, a 32nd per thread, 3 times
    add_arithmetic(flops, wmma, 1)  # 16 x 16 x 16, bfloat16 fragments
    assert flops == {"bf16_tc": 3 * 2 * 16 * 8 * 16 / 32 + 2 * 4096 / 32}


def test_an_add_of_a_product_is_one_fma_per_lane():
    x = tvm.tirx.Var("x", "float32x2")
    flops: dict = {}
    fma = x * x + x
    for node in (fma, fma.a, x * x, x + x):  # each node as the walk visits it: the sum's product counted with
        add_arithmetic(flops, node, 1)  # it, 3 FMA-pipe instructions of 2 lanes
    add_arithmetic(flops, tvm.tirx.Var("i", "int32") * 2 + 1, 1)  # index arithmetic is not counted
    assert flops == {"fp32": 3 * 2 * 2}


def test_a_float32_gemm_is_priced_by_its_fma():
    (name, calls, (t,)), = stitched_module_time(_matmul("float32"), CUDA, H200).kernels
    assert dict(t.geometry.flops).keys() == {"fp32"} and t.flops == GEMM_FLOPS  # every multiply-add read
    assert t.geometry.contraction and t.bound == "compute"
    assert t.us >= GEMM_FLOPS / 67e6  # 2051 us: 67 TFLOP/s of FP32 FMA at most
    assert _physical(t, H200)
    # Its tiles load 12.9 GB from global memory; the L2 serves most: device memory moves the operands
    # in 3 passes (128 MB over a 50 MB L2) and the output once.
    assert t.bytes == 3 * 2 * N * N * 4 + N * N * 4 < t.geometry.accessed_bytes // 20


def test_a_small_float32_gemm_counts_its_operations():
    (name, calls, (t,)), = stitched_module_time(_matmul("float32", 256, 512, 128), CUDA, H200).kernels
    assert t.flops == 2 * 256 * 512 * 128 and _physical(t, H200)


@pytest.mark.slow
def test_a_float16_gemm_on_tensor_cores_is_not_faster_than_their_peak():
    (name, calls, (t,)), = stitched_module_time(_matmul("float16"), CUDA, H200).kernels
    assert dict(t.geometry.flops).get("fp16_tc") == pytest.approx(GEMM_FLOPS / (t.geometry.grid * t.geometry.threads))
    assert t.bound == "compute" and t.us >= GEMM_FLOPS / H200.fp16_tc_flops_per_us / 0.95
    assert GEMM_SHARE / 2 <= t.math_fraction <= 0.95  # published ~75%, within 2x


def test_a_cublas_class_gemm_reaches_a_published_share_of_the_tensor_peak():
    # 4096^3 float16 as cuBLAS-class kernels tile it: 128 x 256 output tiles, 8 warps, K steps of 64 with
    # three stages in shared memory (144 KB: one block per SM), m16n8k16 mma; each thread loads 12
    # 16-byte vectors per step.
    threads, steps = 256, N // 64
    grid = (N // 128) * (N // 256)
    accessed = grid * threads * 12 * steps * 16
    dram = contraction_dram_bytes(Traffic(2 * N * N * 2, N * N * 2, 3 * N * N * 2), accessed, H200)
    gemm = KernelGeometry("cublas_class", grid, threads, loads=((16, 12 * steps),), stores=((16, 64),),
                          load_sites=24, load_phases=steps, barriers=steps, serial_iterations=steps,
                          registers=232, shared_bytes=144 << 10, dram_bytes=dram,
                          flops=(("fp16_tc", GEMM_FLOPS / (grid * threads)),), contraction=True)
    t = kernel_time(gemm, H200)
    assert t.flops == GEMM_FLOPS and t.bound == "compute"
    assert GEMM_SHARE / 2 <= t.math_fraction <= min(1.0, 2 * GEMM_SHARE) and _physical(t, H200)


def test_a_flash_attention_2_shaped_kernel_reaches_its_published_throughput():
    # FlashAttention-2's forward as its paper tiles it (head dim 128: 128 query rows per block of 4 warps,
    # key tiles of 64 staged in shared memory): per score element two mma operations of 128 multiply-adds,
    # one exponential, and four FP32 FMA-pipe operations (scale, the max's subtraction, the row sum, the
    # output's rescale); batch 2 x 16 heads, 16K tokens. The project's own attention kernel uses FMA
    # (docs/attention.md): this prices the kernel's shape, not a kernel of the project.
    batch, length, head, rows, keys, threads = 32, 16384, 128, 128, 64, 128
    grid, tiles = batch * length // rows, length // keys
    flops = 4 * length * length * head * batch
    per_thread = rows * keys * tiles / threads  # score elements of a thread
    attention = KernelGeometry(
        "flash_attention_2", grid, threads, loads=((16, tiles * 2 * keys * head * 2 // 16 // threads),),
        stores=((16, rows * head * 2 // 16 // threads),), load_sites=16, load_phases=tiles, barriers=2 * tiles,
        serial_iterations=tiles, sfu_ops=per_thread, registers=255, shared_bytes=(rows + 2 * keys) * head * 2,
        dram_bytes=4 * batch * length * head * 2, contraction=True,
        flops=(("fp16_tc", flops / (grid * threads)), ("fp32", 8 * per_thread)))
    t = kernel_time(attention, H200)
    tflops = flops / t.us / 1e6
    assert t.bound == "compute" and FA2_TFLOPS / 2 <= tflops <= 2 * FA2_TFLOPS and _physical(t, H200)


def test_the_attention_plans_geometry_carries_its_multiply_adds():
    shape = AttentionShape(batch=8, heads=12, kv_heads=12, q_len=512, kv_len=512, head_dim=64, dtype="float32",
                           scale=0.125, mask="none")
    plan = plan_cuda(shape, H200)
    g = attention_geometry(plan)
    assert dict(g.flops)["fp32"] * g.threads * g.grid == pytest.approx(4 * 8 * 12 * 512 * 512 * 64)
    assert _physical(kernel_time(g, H200), H200)


def test_a_memory_bound_norm_reaches_a_published_share_of_the_bandwidth():
    mod = SUITE["layernorm"].build("float32", dims("bench"))
    priced = stitched_module_time(mod, CUDA, H200)
    (t,) = [t for name, _, times in priced.kernels if name in priced.stitched for t in times]
    assert t.bound == "bandwidth" and NORM_SHARE / 2 <= t.bandwidth_fraction <= 0.9 and _physical(t, H200)


@pytest.mark.parametrize("graph", ["layernorm", "softmax", "bias_gelu"])
def test_no_kernel_is_faster_than_the_peaks(graph):
    priced = stitched_module_time(SUITE[graph].build("float32", dims("bench")), CUDA, H200)
    assert priced.kernels and all(_physical(t, H200) for _, _, times in priced.kernels for t in times)


def test_explain_prints_each_kernels_bound_and_share_of_the_peaks():
    x, w = tensor("x", (2048, 1024)), tensor("w", (1024, 256))
    mod = make_module([x, w], lambda bb, x, w: bb.emit(op.matmul(op.nn.softmax(op.exp(x), axis=-1), w)))
    text = comparison(mod, CUDA, H200, bounds=True)
    (gemm,) = [line for line in text.splitlines() if line.startswith("matmul_kernel") and "compute" in line][:1]
    assert "kernels of the stitched build:" in text and "kernels of TVM's default build:" in text
    assert any(line.startswith("stitch_") and " bandwidth " in line for line in text.splitlines())
    assert gemm.split()[-2].endswith("%") and int(gemm.split()[-2][:-1]) > 30  # its share of the math peak
