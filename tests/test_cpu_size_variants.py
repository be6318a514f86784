"""On the CPU, a kernel of symbolic row count built once cuts few long rows into chunks over the cores where
its size calls for it, as the static build does, and runs the plan for every size otherwise."""

import dataclasses

import numpy as np
import pytest
import tvm_ffi
from tvm import tirx

from tvm_stitch.kernels.variants import ATTR, branch_at
from tvm_stitch.planning.cpu.variants import chunked_range
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.variants import SizeRange
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build, run_cpu

from conftest import kernel_with, np_softmax, symbolic_softmax

N = tirx.Var("n", "int64")
LONG = 65536


def _two_cores():
    """The host's spec with 2 cores, whatever the runtime's thread count (the plans the tests read)."""
    return dataclasses.replace(TargetSpec.from_target(host_target()), cores=2)


def _parallel_extents(func) -> list:
    """Extents of the parallel loops of a scheduled PrimFunc, in order."""
    out = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda loop: out.append(int(loop.extent))
                                        if loop.kind == tirx.ForKind.PARALLEL else None), order="pre")
    return out


def test_the_counts_whose_rows_the_rules_cut_form_one_range():
    # rows of 2^15 elements or more, fewer rows than cores: cores the plan for every size leaves idle
    assert chunked_range("n", None, None, LONG, 2) == SizeRange("n", None, 1)
    assert chunked_range("n", 3, 5, LONG, 16) == SizeRange("n", None, 5)
    assert chunked_range("n", 1, None, LONG, 16) == SizeRange("n", None, 15)
    assert chunked_range("n", None, None, LONG, 16, rows_per_count=3) == SizeRange("n", None, 5)  # (n, 3, 65536)
    assert chunked_range("n", None, None, LONG, 2, rows_per_count=3) is None  # 3 rows: both cores busy
    assert chunked_range("n", 2, None, LONG, 2) is None  # never fewer rows than cores
    assert chunked_range("n", 8, None, LONG, 2) is None
    assert chunked_range("n", None, None, 16384, 2) is None  # rows too short to cut
    assert chunked_range("n", None, None, LONG, 1) is None  # one core: nothing to spread
    assert chunked_range("n", None, None, None, 2) is None  # rows of symbolic length


def test_few_long_rows_run_the_chunked_plan_and_many_rows_the_plan_for_every_size(rng):
    spec = _two_cores()
    built = build(symbolic_softmax((N, LONG)), host_target(), stitched=True, spec=spec)
    (group,) = built.report.groups
    assert [(c, p.mapping.split) for c, p in group.variants] == [("n <= 1", 8), ("otherwise", 1)]
    assert "8 chunks/row over 2 cores" in built.report.table()
    dispatch = kernel_with(built, ATTR)
    # at 1 row the variant is the static build's kernel: each row cut into 8 chunks, one parallel loop per block
    static = build(symbolic_softmax((1, LONG)), host_target(), stitched=True, spec=spec)
    assert _parallel_extents(branch_at(dispatch, {"n": 1})) == _parallel_extents(kernel_with(static, "tvm_stitch.plan"))
    assert _parallel_extents(branch_at(dispatch, {"n": 1})) == [8, 8, 8, 8]
    assert _parallel_extents(branch_at(dispatch, {"n": 2})) == [2]  # as many rows as cores: row tasks
    assert _parallel_extents(branch_at(dispatch, {"n": 64})) == [64]  # row tasks over the cores
    for rows in (1, 2, 7, 33):  # the variant's one size, three of the plan for every size
        x = rng.standard_normal((rows, LONG)).astype("float32")
        (out,) = run_cpu(built.executable, [x])
        np.testing.assert_allclose(out, np_softmax(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape, bounds", [((N, 1024), None), ((N, LONG), (8, 4096))],
                         ids=["short-rows", "never-few-rows"])
def test_no_variant_where_the_rules_cut_no_rows(shape, bounds, rng):
    built = build(symbolic_softmax(shape, bounds), host_target(), stitched=True, spec=_two_cores())
    (group,) = built.report.groups
    assert group.stitched and group.variants == () and group.plan.mapping.split == 1
    assert ATTR not in kernel_with(built, "tvm_stitch.plan").attrs
    x = rng.standard_normal((9, shape[1])).astype("float32")
    (out,) = run_cpu(built.executable, [x])
    np.testing.assert_allclose(out, np_softmax(x), rtol=1e-5, atol=1e-7)


def test_a_variant_that_does_not_build_falls_back_to_the_plan_for_every_size(monkeypatch, rng):
    from tvm_stitch.stitch import kernel_maker

    checked = kernel_maker.check_builds

    def refusing_dispatches(func, target):
        if func.attrs is not None and ATTR in func.attrs:
            raise RuntimeError("no dispatch")
        checked(func, target)

    monkeypatch.setattr(kernel_maker, "check_builds", refusing_dispatches)
    built = build(symbolic_softmax((N, LONG)), host_target(), stitched=True, spec=_two_cores())
    (group,) = built.report.groups
    assert group.stitched and group.variants == () and group.plan.mapping.split == 1
    assert any("size variants not built" in note for note in built.report.notes)
    x = rng.standard_normal((1, LONG)).astype("float32")
    np.testing.assert_allclose(run_cpu(built.executable, [x])[0], np_softmax(x), rtol=1e-5, atol=1e-7)
