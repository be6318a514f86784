"""Row-split (global stitching across blocks) for few long rows on CUDA.

The CUDA schedule is built without thread bindings for llvm and checked
against numpy; the CUDA build is counted and compiled with nvcc.
"""

import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm

from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.planning.row_split import choose_split
from tvm_stitch.tools.suite import SUITE, reference

from conftest import CUDA, LLVM

LONG = {"rows": 16, "cols": 20000}  # 16 rows: far fewer than SMs; 80 KB rows: more than shared memory


def _check_numerics(name: str, dims: dict) -> list:
    graph = SUITE[name]
    inputs = graph.inputs(np.random.default_rng(1), "float32", dims)
    built = build(graph.build("float32", dims), LLVM, stitched=True, strict=True, emulate="cuda")
    outs = run_cpu(built.executable, inputs)
    for out, ref in zip(outs, reference(graph, [i.astype("float64") for i in inputs])):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    return built.report.plans


@pytest.mark.parametrize("name,kernels", [("softmax", 3), ("layernorm", 3), ("rmsnorm", 2)])
def test_long_rows_split_over_blocks_match_numpy(name, kernels):
    plans = _check_numerics(name, LONG)
    assert len(plans) == 1
    plan = plans[0]
    assert plan.scheme == "row-split" and plan.kernels == kernels
    assert plan.mapping.split == choose_split(16, 20000) > 1
    assert plan.mapping.grid == 16 * plan.mapping.split


def test_split_cuda_launches_and_plan_text():
    mod = SUITE["softmax"].build("float32", LONG)
    stitched = build(mod, CUDA, stitched=True, strict=True)
    default = build(mod, CUDA, stitched=False)
    assert count_launches(stitched.lowered, stitched.executable) == 3
    assert count_launches(default.lowered, default.executable) >= 3
    table = stitched.report.table()
    assert "row-split" in table and "blocks/row" in table
    assert "global stitching in 3 kernels" in stitched.report.details()


def test_long_chain_with_per_row_outputs_is_split_when_rows_do_not_fit():
    """LayerNorm with mean and rstd outputs: per-row outputs in a split plan, or row-resident."""
    plans = _check_numerics("layernorm_stats", LONG)
    assert len(plans) == 1


def test_split_choice():
    assert choose_split(64, 30000) == 5  # 320 blocks, chunks of 6000
    assert choose_split(16, 20000) == 8  # as many as chunks of >= 2048 allow
    assert choose_split(64, 30011) == 1  # prime: no even chunks


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_split_cuda_compiles_with_vector_accesses(tmp_path):
    mod = SUITE["softmax"].build("float32", {"rows": 64, "cols": 32768})
    built = build(mod, CUDA, stitched=True, strict=True)
    assert built.report.plans[0].mapping.vector == 4
    source = cuda_source(built.executable)
    assert "float4" in source
    path = tmp_path / "k.cu"
    path.write_text(source)
    result = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                             str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stdout + result.stderr)]
    assert spills and max(spills) == 0


def test_independent_column_sums_split_and_match_numpy():
    """Two independent column reductions (dgamma, dbeta) walking 16384 rows of 64 columns: two warps
    would walk them alone; split, the partials of both run in one kernel, the combines in the next."""
    plans = _check_numerics("layernorm_backward", {"rows": 16384, "cols": 64})
    split = [p for p in plans if p.scheme == "row-split"]
    assert len(split) == 1 and split[0].mapping.threads == 1 and split[0].mapping.split > 1
    assert split[0].kernels == 2
