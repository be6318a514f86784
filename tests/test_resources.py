"""Register and occupancy estimates of CUDA plans, checked against ptxas."""

import re

import pytest
import tvm

from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.planning.resources import cuda_shared_bytes, occupancy
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.workloads import SUITE, dims

from conftest import CUDA, needs_nvcc, nvcc


def test_occupancy_limits():
    sm = TargetSpec.from_target(CUDA)  # sm_90
    assert occupancy(256, 32, 0, sm) == 1.0  # 8 blocks of 8 warps, 64K registers
    assert occupancy(256, 64, 0, sm) == 0.5  # registers limit to 4 blocks
    assert occupancy(256, 32, 48 * 1024, sm) == 0.5  # 228 KB of shared memory holds 4 blocks
    assert occupancy(32, 16, 0, sm) == 0.5  # 32 blocks of one warp
    ampere = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_86"}))
    assert occupancy(256, 32, 0, ampere) == 1.0  # 6 blocks of 8 warps fill its 1536 threads
    assert occupancy(1024, 32, 0, ampere) == 2 / 3  # one block of 1024: 32 of 48 warps


def test_shared_bytes_pad_arrays_and_stage_multiwarp_reductions():
    assert cuda_shared_bytes([512, 4], [(4, 1)], 32, 8, 32) == 4096 + 64  # one warp per row: shuffles only
    # 192 threads: per row 6 staged values and the broadcast result, each array padded to 64 bytes
    assert cuda_shared_bytes([3072], [(4, 1), (2, 1)], 192, 1, 32) == 3072 + 2 * (64 + 64)
    assert cuda_shared_bytes([], [(4, 1)], 64, 4, 32) == 64 + 64  # 2 warps x 4 rows, 4 results
    assert cuda_shared_bytes([], [(4, 256)], 256, 1, 32) == 0  # an output per thread: reduced serially


# Attention scores of (2, 3, 128) rows: 4 rows per block, across all three row axes.
PACKED_ROWS = {**dims("test"), "seq": 128}


def _ptxas(built, tmp_path) -> str:
    """ptxas's report (-v) on the CUDA source of a build."""
    return nvcc(cuda_source(built.executable), tmp_path)


def _static_shared(report: str) -> dict:
    """Kernel name -> static shared memory in bytes (0 when ptxas reports none)."""
    shared = {}
    for entry in re.split(r"(?=Compiling entry function)", report)[1:]:
        name = re.match(r"Compiling entry function '(\w+)'", entry).group(1)
        used = re.search(r"(\d+) bytes smem", entry)
        shared[name] = int(used.group(1)) if used else 0
    return shared


@needs_nvcc
@pytest.mark.parametrize("name, dtype, size", [
    ("attention_softmax", "float16", PACKED_ROWS),  # rows packed over several row axes
    ("attention_softmax", "float32", PACKED_ROWS),
    ("layernorm_softmax", "float16", dims("test")),  # all-reduce staging past one warp
    ("softmax_short_rows", "float16", dims("test")),  # rows packed over one axis
    ("softmax_long_rows", "float32", dims("test")),  # row-split
])
def test_shared_estimate_bounds_ptxas(name, dtype, size, tmp_path):
    built = build(SUITE[name].build(dtype, size), CUDA, stitched=True, strict=True)
    shared = _static_shared(_ptxas(built, tmp_path))
    for plan in built.report.plans:
        kernels = [k for k in shared if re.fullmatch(rf"{plan.kernel}_kernel(_\d+)?", k)]
        assert kernels, (plan.kernel, shared)
        for kernel in kernels:
            assert shared[kernel] <= plan.shared_bytes <= plan.spec.shared_bytes_per_block, (kernel, shared[kernel], plan)
    if size is PACKED_ROWS:
        (plan,) = built.report.plans
        assert plan.rank == 3 and plan.mapping.rows_per_task > 1
        assert max(shared.values()) > 0


@needs_nvcc
@pytest.mark.parametrize("name", ["layernorm_softmax", "layernorm_backward", "bias_gelu", "softmax"])
def test_register_estimate_close_to_ptxas(name, tmp_path):
    built = build(SUITE[name].build("float32", dims("test")), CUDA, stitched=True, strict=True)
    used = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", _ptxas(built, tmp_path),
                           re.S))
    for plan in built.report.plans:
        actual = int(used[f"{plan.kernel}_kernel"])
        assert plan.registers / 2 <= actual <= plan.registers * 3 / 2, (plan.kernel, plan.registers, actual)
        assert 0 < plan.occupancy <= 1
