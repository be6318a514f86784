"""A row-split plan in one launch: each row's later phases run in the row's last block to arrive.

The twin of a row-split plan of several launches (planning/cuda/last_block_rows,
schedules/cuda/last_block_rows): every block writes its chunk's partials and
takes a ticket at its row's arrival counter; the row's last block runs the
later phases over the whole row. Checked: which plans have a twin, one CUDA
launch priced as all blocks then one block per row, numerics under the SIMT
checker on pocl (the counters run twice) and Oclgrind (slow tier), nvcc
with no spills; a chain of three phases keeps its launches.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import tvm

import tvm_stitch  # noqa: F401  (imports the pass before schedules: the package's order)
from schedules import schedule_for
from tvm_stitch.analysis.reshaped_rows import rows_through_reshape
from tvm_stitch.planning.candidates import candidates
from tvm_stitch.planning.cuda.last_block_rows import last_block_plan
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.kernel_geometry import kernel_geometries
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.tools.build import build
from tvm_stitch.tools.idle_graphs import group_norm
from tvm_stitch.tools.launches import count_launches, cuda_source
from tvm_stitch.tools.tune import fused_groups

from conftest import CUDA, needs_nvcc, nvcc, opencl_device
from test_row_split import sum_of_exp_of_twice_x

SM90 = TargetSpec.from_target(CUDA)


def _group_norm_split(shape=(2, 8, 64, 64), groups=2):
    """(func with the groups as rows, the two-launch row-split plan of the fewest chunks, its twin)."""
    ((fused, rule),) = fused_groups(group_norm(shape, groups), CUDA)
    plans = candidates(fused, rule, SM90)
    splits = [p for p in plans if p.scheme == "row-split" and not p.mapping.last_block_rows]
    two = min(splits, key=lambda p: p.mapping.split)
    return rows_through_reshape(fused, two.reshaped), two, last_block_plan(two)


def _three_phases():
    """The row-split plan of three phases of max(x), then sum(exp(2x - max)), then the normalised values."""
    ((fused, rule),) = fused_groups(sum_of_exp_of_twice_x(), CUDA)
    (three,) = [p for p in candidates(fused, rule, SM90) if p.scheme == "row-split" and p.kernels == 3
                and p.mapping.split == rule.mapping.split]
    return fused, three


def test_a_row_split_plan_of_several_launches_has_a_one_launch_twin():
    _, two, twin = _group_norm_split()
    assert two.kernels == 2 and twin.kernels == 1 and twin.phase_count == 2
    assert twin.mapping == dataclasses.replace(two.mapping, last_block_rows=True)
    assert "last block" in twin.notes[-1]
    assert last_block_plan(twin) is None  # already one launch
    column_walk = dataclasses.replace(two, mapping=dataclasses.replace(two.mapping, threads=1))
    assert last_block_plan(column_walk) is None
    assert last_block_plan(dataclasses.replace(two, scheme="row-resident")) is None


def test_the_twin_is_one_launch_priced_as_every_block_then_one_block_per_row():
    func, two, twin = _group_norm_split()
    (kernel,) = kernel_geometries(schedule_for(func, twin, CUDA).mod["main"], CUDA)
    assert len(kernel_geometries(schedule_for(func, two, CUDA).mod["main"], CUDA)) == 2
    assert [m.grid for m in kernel.members] == [twin.mapping.grid, twin.mapping.rows]


def test_group_norm_in_one_launch_matches_numpy_on_pocl_and_leaves_the_counters_at_zero():
    func, _, twin = _group_norm_split()
    device = opencl_device(False)
    check = check_kernel("group_norm", schedule_for(func, twin, CUDA).mod["main"],
                         [Reference(func, tuple(range(len(func.params))))], device, False, 0)
    assert check.ok and check.launches == 1, check.detail


def test_a_three_phase_chain_keeps_its_launches():
    _, three = _three_phases()
    assert three.kernels == 3 and last_block_plan(three) is None


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_group_norm_in_one_launch_compiles_without_spills_with_one_kernel(arch, tmp_path):
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    built = build(group_norm((8, 32, 64, 64), 8), target, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.mapping.last_block_rows
    assert count_launches(built.lowered, built.executable) == 1
    source = cuda_source(built.executable)
    assert len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))) == 1
    assert "tvm_stitch_arrival" in source
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(source, tmp_path, arch=arch))]
    assert spills and max(spills) == 0


def test_a_row_counter_left_set_fails_on_pocl(monkeypatch):
    """Without the last block's reset, the second run's tickets start at `split`: no block finishes a row."""
    from tvm import tirx

    from schedules.cuda import arrivals

    monkeypatch.setattr(arrivals, "reset", lambda slot: tirx.const(0, "int32"))
    func, _, twin = _group_norm_split()
    device = opencl_device(False)
    check = check_kernel("group_norm", schedule_for(func, twin, CUDA).mod["main"],
                         [Reference(func, tuple(range(len(func.params))))], device, False, 0)
    assert not check.ok and "second run" in check.detail, check.detail
