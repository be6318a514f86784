"""Rows that come through a reshape (GroupNorm's groups) split over blocks on CUDA.

The row-resident plan of a GroupNorm has the batch as its rows (the groups
hide behind the reshape); the row-split candidate takes (batch, group) as
rows once the block that reshapes back is re-laid over the grouped tensor
(analysis/reshaped_rows.py). Checked like the other schemes: the CUDA schedule
without thread bindings on llvm against numpy, the CUDA kernels under the SIMT
checker on pocl and Oclgrind, nvcc for sm_80 and sm_90 with no spills.
"""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir

from tvm_stitch import simt
from tvm_stitch.analysis.reshaped_rows import reshaping_blocks, rows_through_reshape
from tvm_stitch.analysis.row_axes import ROW_AXES_ATTR
from tvm_stitch.analysis.tir_view import block_views
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.idle_graphs import GRAPHS, group_norm
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.tune import fused_groups

from conftest import CUDA, LLVM, needs_nvcc, nvcc, opencl_device

SMALL = ((2, 8, 64, 64), 2)  # 4 groups of 16384: the rule plan has 2 blocks (one per batch)


def _np_group_norm(x, groups):
    n = x.shape[0]
    g = x.reshape(n, groups, -1).astype("float64")
    mean = g.mean(-1, keepdims=True)
    var = ((g - mean) ** 2).mean(-1, keepdims=True)
    return ((g - mean) / np.sqrt(var + 1e-5)).reshape(x.shape)


def test_the_block_that_reshapes_back_is_found_and_re_laid_over_the_groups():
    ((fused, rule),) = fused_groups(group_norm(*SMALL), CUDA)
    assert rule.scheme == "row-resident" and rule.mapping.rows == 2
    names = reshaping_blocks(fused)
    assert len(names) == 1
    moved = rows_through_reshape(fused, names)
    assert ROW_AXES_ATTR in moved.attrs
    (view,) = [v for v in block_views(s_tir.Schedule(moved)) if v.name == names[0]]
    assert [int(e) for e in view.extents] == [2, 2, 16384]
    assert [str(i) for i in view.reads[0].indices] == [str(v) for v in view.iter_vars]


def test_group_norm_groups_split_over_blocks_match_numpy():
    shape, groups = SMALL
    x = np.random.default_rng(3).standard_normal(shape).astype("float32")
    built = build(group_norm(shape, groups), LLVM, stitched=True, strict=True, emulate="cuda")
    (plan,) = built.report.plans
    assert plan.scheme == "row-split" and plan.reshaped and plan.mapping.rows == 4
    assert plan.mapping.split > 1 and plan.phase_count == 2 and len(plan.variance) == 1
    (out,) = run_cpu(built.executable, [x])
    np.testing.assert_allclose(out, _np_group_norm(x, groups), rtol=1e-4, atol=1e-4)
    assert StitchPlan.from_json(plan.to_json()).reshaped == plan.reshaped


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_half_group_norm_takes_its_variance_in_the_mean_pass_and_one_launch(dtype, tol):
    """The squares rounded in half precision and summed in float32: one pass with the mean, so two
    phases, which share one CUDA launch (each group's last block normalises it)."""
    import ml_dtypes

    shape, groups = SMALL
    x = np.random.default_rng(4).standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == "bfloat16"
                                                                  else np.float16)
    built = build(group_norm(shape, groups, dtype), LLVM, stitched=True, strict=True, emulate="cuda")
    (plan,) = built.report.plans
    assert plan.scheme == "row-split" and len(plan.variance) == 1 and plan.phase_count == 2
    (out,) = run_cpu(built.executable, [x])
    np.testing.assert_allclose(out.astype("float32"), _np_group_norm(x.astype("float32"), groups), rtol=tol, atol=tol)
    opencl_device(False)
    report = simt.check(group_norm(shape, groups, dtype))
    assert report.ok and [k.launches for k in report.kernels] == [1], str(report)
    assert report.stitch.plans[0].mapping.last_block_rows


@pytest.mark.slow
def test_group_norm_split_is_chosen_by_modeled_time_and_launches_once():
    built = build(GRAPHS["group_norm_8x32x64x64_g8"](), CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.scheme == "row-split" and plan.mapping.rows == 64 and plan.mapping.grid >= 64 * 2
    assert plan.mapping.last_block_rows and plan.phase_count == 2
    assert count_launches(built.lowered, built.executable) == 1
    (note,) = [n for n in plan.notes if n.startswith("time model:")]
    rule_us = float(re.search(r"against the rules' ([0-9.]+) us", note).group(1))
    assert 0 < plan.modeled_us < rule_us / 4


def test_group_norm_split_runs_on_pocl_with_simt_semantics():
    opencl_device(False)
    report = simt.check(group_norm(*SMALL))
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)


@pytest.mark.slow
def test_group_norm_split_is_clean_under_oclgrind():
    opencl_device(True)
    report = simt.check(group_norm((1, 2, 128, 128), 2), oclgrind=True)  # 2 groups of 16384
    assert [k.launches for k in report.kernels] == [1], str(report)
    assert report.ok, str(report)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_group_norm_split_compiles_without_spills(arch, tmp_path):
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    built = build(group_norm((2, 64, 128, 128), 32), target, stitched=True, strict=True)
    assert built.report.plans[0].scheme == "row-split"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(cuda_source(built.executable), tmp_path,
                                                                           arch=arch))]
    assert spills and max(spills) == 0
