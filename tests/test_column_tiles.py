"""Column tiles: a reduction over a middle axis and the element-wise work after it in one launch that fills
the GPU (planning/cuda/column_tiles.py).

The rule plan gives each row (a column of x (A, B, C) over B) one thread;
the column-tile plan puts a tile of columns across threadIdx.x and cuts each
column over threadIdx.y threads, combined in shared memory. Checked like the
other schemes: the CUDA schedule without thread bindings on llvm against numpy,
the CUDA kernels under the SIMT checker on pocl and Oclgrind, nvcc for sm_80
and sm_90 with no spills, and the time model's choice on sm_90.
"""

import re

import numpy as np
import pytest
import tvm

from tvm_stitch import simt
from tvm_stitch.planning.cuda.column_tiles import column_tile_plans, offered
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.idle_guard import bandwidth_share
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.idle_graphs import GRAPHS, middle_axis_exp, middle_axis_norm
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.tune import fused_groups
from tvm_stitch.tools.workloads import SUITE, dims

from conftest import CUDA, LLVM, needs_nvcc, nvcc, opencl_device

SMALL = (4, 256, 32)  # 128 columns of 256


def _np_exp(x):
    return np.exp(x - x.mean(1, keepdims=True))


def _np_norm(x):
    y = x.astype("float64")
    centred = y - y.mean(1, keepdims=True)
    return centred / np.sqrt((centred ** 2).mean(1, keepdims=True) + 1e-5)


def _rule(mod):
    """The group of the most ops (the stitch pass also plans the fusion search's smaller groups)."""
    return max(fused_groups(mod, CUDA), key=lambda group: len(group[1].ops))


def test_tiles_are_offered_for_a_thread_per_column_rule_only():
    spec = TargetSpec.from_target(CUDA)
    fused, rule = _rule(middle_axis_exp(SMALL))
    assert rule.scheme == "row-resident" and rule.row_axes and rule.mapping.threads == 1
    assert offered(rule, spec)
    plans = column_tile_plans(fused, rule, spec)
    assert plans and all(p.mapping.across and p.mapping.threads > 1 for p in plans)
    for plan in plans:
        m = plan.mapping
        assert m.grid * m.rows_per_task == m.rows == 4 * 32 and 256 % m.threads == 0
        assert m.rows_per_task * 4 >= 32  # a tile spans at least one 32-byte sector per step
        assert plan.shared_bytes <= spec.shared_bytes_per_block
    layernorm = SUITE["layernorm"]
    fused, rule = _rule(layernorm.build("float32", dims("test")))
    assert not offered(rule, spec) and column_tile_plans(fused, rule, spec) == []


@pytest.mark.parametrize("make, reference", [(middle_axis_exp, _np_exp), (middle_axis_norm, _np_norm)],
                         ids=["exp", "norm"])
def test_column_tiles_match_numpy(make, reference):
    x = np.random.default_rng(5).standard_normal(SMALL).astype("float32")
    built = build(make(SMALL), LLVM, stitched=True, strict=True, emulate="cuda")
    (plan,) = built.report.plans
    assert plan.mapping.across and plan.mapping.threads > 1 and plan.mapping.rows_per_task > 1
    (out,) = run_cpu(built.executable, [x])
    np.testing.assert_allclose(out, reference(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["middle_axis_exp_64x1024x32", "middle_axis_exp_64x512x64",
                                  "middle_axis_norm_32x2048x64"])
def test_a_middle_axis_reduction_is_one_launch_that_fills_the_gpu(name):
    """Chosen by modeled time over the thread-per-column rule plan (and, for the mean and exp, over the
    fusion search's two kernels: a column-split mean, then the exp): one launch at half the peak or more."""
    built = build(GRAPHS[name](), CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    spec = plan.spec
    assert plan.mapping.across and count_launches(built.lowered, built.executable) == 1
    assert plan.mapping.grid >= spec.sms
    (note,) = [n for n in plan.notes if n.startswith("time model:")]
    rule_us = float(re.search(r"against the rules' ([0-9.]+) us", note).group(1))
    assert 0 < plan.modeled_us < rule_us / 5
    assert bandwidth_share(plan) >= 0.5 and plan.idle is None


@pytest.mark.parametrize("make", [middle_axis_exp, middle_axis_norm], ids=["exp", "norm"])
def test_column_tiles_run_on_pocl_with_simt_semantics(make):
    opencl_device(False)
    report = simt.check(make(SMALL))
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)
    assert "cross-thread reductions ran" in str(report)


@pytest.mark.parametrize("make", [middle_axis_exp, middle_axis_norm], ids=["exp", "norm"])
def test_column_tiles_are_clean_under_oclgrind(make):
    """Two reductions over threadIdx.y (the norm's mean and variance) and the mean read by every thread of
    its column: no race (a mean kept once per column in shared memory, or stored over the all-reduce's
    result, raced)."""
    opencl_device(True)
    report = simt.check(make((2, 256, 16)), oclgrind=True)
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["middle_axis_exp_64x1024x32", "middle_axis_norm_32x2048x64"])
def test_column_tiles_compile_without_spills(name, arch, tmp_path):
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    built = build(GRAPHS[name](), target, stitched=True, strict=True)
    assert built.report.plans[0].mapping.across
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(cuda_source(built.executable), tmp_path,
                                                                           arch=arch))]
    assert spills and max(spills) == 0
