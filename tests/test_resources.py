"""Register and occupancy estimates of CUDA plans, checked against ptxas."""

import re
import shutil
import subprocess

import pytest
import tvm

from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.planning.resources import occupancy
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.suite import SUITE, dims

from conftest import CUDA


def test_occupancy_limits():
    sm = TargetSpec.from_target(CUDA)  # sm_90
    assert occupancy(256, 32, 0, sm) == 1.0  # 8 blocks of 8 warps, 64K registers
    assert occupancy(256, 64, 0, sm) == 0.5  # registers limit to 4 blocks
    assert occupancy(256, 32, 48 * 1024, sm) == 0.5  # 228 KB of shared memory holds 4 blocks
    assert occupancy(32, 16, 0, sm) == 0.5  # 32 blocks of one warp
    ampere = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_86"}))
    assert occupancy(256, 32, 0, ampere) == 1.0  # 6 blocks of 8 warps fill its 1536 threads
    assert occupancy(1024, 32, 0, ampere) == 2 / 3  # one block of 1024: 32 of 48 warps


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("name", ["layernorm_softmax", "layernorm_backward", "bias_gelu", "softmax"])
def test_register_estimate_close_to_ptxas(name, tmp_path):
    built = build(SUITE[name].build("float32", dims("test")), CUDA, stitched=True, strict=True)
    path = tmp_path / "k.cu"
    path.write_text(cuda_source(built.executable))
    result = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                             str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    used = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", result.stdout + result.stderr,
                           re.S))
    for plan in built.report.plans:
        actual = int(used[f"{plan.kernel}_kernel"])
        assert plan.registers / 2 <= actual <= plan.registers * 3 / 2, (plan.kernel, plan.registers, actual)
        assert 0 < plan.occupancy <= 1
