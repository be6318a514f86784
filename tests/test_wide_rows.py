"""Spatial-only CUDA kernels whose rows are too few for a thread each (planning/cuda/fill.few_wide_rows).

A rotary embedding recomputed in a backward step keeps its slices as outputs, so its concat (a
gather within the last axis) leaves rows of 64 elements: 4096 rows at LLaMA's bench size. A thread
per row gave 4096 threads walking 64 elements each; the rows are now spread over threads as a
reduction's are, the gathered values in shared memory.
"""

import re

import numpy as np
import pytest
from tvm import relax

from tvm_stitch.planning.cuda import fill
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import cuda_source

from conftest import CUDA, LLVM, make_module, needs_nvcc, nvcc, opencl_device, tensor

op = relax.op
BENCH = (4, 8, 128, 64)


def _rotate_half_with_slices(shape):
    """rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2]), its two halves outputs too."""
    x = tensor("x", shape)
    d, axis = shape[-1], len(shape) - 1

    def body(bb, x):
        first = bb.emit(op.strided_slice(x, [axis], [0], [d // 2]))
        negated = bb.emit(op.negative(op.strided_slice(x, [axis], [d // 2], [d])))
        return bb.emit(relax.Tuple([first, negated, bb.emit(op.concat([negated, first], axis=axis))]))

    def ref(a):
        return [a[..., :d // 2], -a[..., d // 2:], np.concatenate([-a[..., d // 2:], a[..., :d // 2]], axis=-1)]

    return make_module([x], body), ref


def _plan(mod, **options):
    built = build(mod, CUDA, stitched=True, strict=True, **options)
    (plan,) = built.report.plans
    return plan


def test_few_wide_rows_are_spread_over_threads_and_modeled_faster(monkeypatch):
    mod, _ = _rotate_half_with_slices(BENCH)
    spread = _plan(mod)
    rows = 4 * 8 * 128
    assert spread.mapping.rows == rows and spread.mapping.threads > 1
    assert spread.mapping.grid * spread.threads_per_block >= fill.fill_threads(spread.spec)
    monkeypatch.setattr("tvm_stitch.planning.cuda.row_resident.few_wide_rows", lambda *args: False)
    walked = _plan(mod)
    assert walked.mapping.threads == 1 and walked.mapping.grid * walked.threads_per_block == rows
    assert spread.modeled_us < walked.modeled_us / 2


def test_many_rows_keep_a_thread_per_row():
    assert not fill.few_wide_rows(1 << 17, 64, _plan(_rotate_half_with_slices(BENCH)[0]).spec)


def test_spread_rows_that_do_not_fit_on_chip_keep_a_thread_per_row(rng):
    # 16 rows of 65536: each row's halves (128 KB) would not fit a block's shared memory.
    mod, ref = _rotate_half_with_slices((16, 65536))
    a = rng.standard_normal((16, 65536)).astype("float32")
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    assert [p.mapping.threads for p in built.report.plans] == [1]
    for out, expected in zip(run_cpu(built.executable, [a]), ref(a)):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("shape,share", [(BENCH, fill.FILL_SHARE), ((2, 2, 16, 64), 4096)])
def test_spread_rows_match_numpy_emulated(shape, share, rng, monkeypatch):
    monkeypatch.setattr(fill, "FILL_SHARE", share)  # a small GPU to fill: the small shape takes the rule too
    mod, ref = _rotate_half_with_slices(shape)
    a = rng.standard_normal(shape).astype("float32")
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda")
    assert built.report.plans[0].mapping.threads > 1
    for out, expected in zip(run_cpu(built.executable, [a]), ref(a)):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_spread_rows_are_clean_under_simt(oclgrind, monkeypatch):
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    opencl_device(oclgrind)
    monkeypatch.setattr(fill, "FILL_SHARE", 4096)
    report = simt.check(_rotate_half_with_slices((2, 2, 16, 64))[0], oclgrind=oclgrind)
    assert report.ok, str(report)
    assert report.stitch.plans[0].mapping.threads > 1, str(report)


@needs_nvcc
def test_spread_rows_compile_with_nvcc_without_spills(tmp_path):
    built = build(_rotate_half_with_slices(BENCH)[0], CUDA, stitched=True, strict=True)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(cuda_source(built.executable), tmp_path))]
    assert spills and max(spills) == 0
