"""The generated CUDA compiles with nvcc for sm_90 (and sm_80), without spills."""

import re

import pytest

from conftest import needs_nvcc, nvcc
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.tools.workloads import SUITE, dims

pytestmark = needs_nvcc


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", ["layernorm_softmax", "cross_entropy", "residual_layernorm"])
def test_stitched_cuda_compiles_without_spills(name, arch, tmp_path):
    built = build(SUITE[name].build("float32", dims("bench")), {"kind": "cuda", "arch": arch}, stitched=True)
    report = nvcc(cuda_source(built.executable), tmp_path, arch=arch)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
    shared = [int(n) for n in re.findall(r"(\d+) bytes smem", report)]
    assert all(s <= 48 * 1024 for s in shared), report


def test_llama_backward_cuda_compiles(tmp_path):
    """The whole CUDA source of LLaMA's training step (the rotary embedding's slice_scatter folds into
    dlight's matmul loads: a select under a vectorised loop, see schedules/cuda/vector_selects)."""
    from tvm_stitch.tools.model_bench import import_step

    mod, _, _ = import_step("llama", "backward", "test")
    built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    nvcc(cuda_source(built.executable), tmp_path, ptx=True, timeout=600)
