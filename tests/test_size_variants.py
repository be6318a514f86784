"""A kernel of symbolic row count built once runs, per call, the plan its size calls for (size variants)."""

import re

import numpy as np
import pytest
import tvm
from tvm import tirx

from tvm_stitch.stitch import module_pass
from tvm_stitch.pricing.kernel_geometry import kernel_geometries
from tvm_stitch.pricing.modeled_time import cuda_target
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.kernels.variants import ATTR, least_us, branch_at, launches_at
from tvm_stitch.planning.plan import StitchPlan, ThreadMapping
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import KernelGeometry, kernel_time
from tvm_stitch.planning.variants import SizeRange, Variant, merged, ranges, sample_sizes, sampled_plans
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source

from conftest import kernel_with, needs_nvcc, np_softmax, nvcc, symbolic_softmax

CUDA = {"kind": "cuda", "arch": "sm_90"}
N = tirx.Var("n", "int64")


def _softmax(shape, upper=None):
    return symbolic_softmax(shape, None if upper is None else (1, upper))


def _launches_and_bytes(func, spec):
    traffic = modeled_traffic(func, spec).total
    return [(g.grid, g.threads) for g in kernel_geometries(func, cuda_target(spec), -1, traffic)], traffic


def _as_static_build(symbolic, rows: int, length: int) -> None:
    """The variant the symbolic build runs at `rows` launches and moves what the static build's kernel does."""
    static = build(_softmax((rows, length)), CUDA, stitched=True)
    spec = symbolic.report.spec
    chosen = branch_at(kernel_with(symbolic, ATTR), {"n": rows})
    assert _launches_and_bytes(chosen, spec) == _launches_and_bytes(kernel_with(static, "tvm_stitch.plan"), spec)
    assert launches_at(kernel_with(symbolic, ATTR), rows) == count_launches(static.lowered, static.executable)


def _plan(rows_per_task=1, threads=32, split=1, scheme="row-resident"):
    mapping = ThreadMapping(rows=-1, rows_per_task=rows_per_task, threads=threads, vector=1, grid=-1, split=split)
    return StitchPlan("k", "cuda", scheme, ("a",), ("a",), 1, ("n",), mapping)


def test_sample_sizes_and_the_ranges_of_the_plans_made_there():
    assert sample_sizes(1, 1 << 20) == [1, 8, 64, 512, 4096, 32768, 262144, 1 << 20]
    assert sample_sizes(2, 128) == [2, 8, 64, 128]
    assert sample_sizes(5, 5) == [5]
    general, packed, split = _plan(), _plan(rows_per_task=8), _plan(threads=256, split=10, scheme="row-split")
    samples = [1, 8, 64, 512, 4096]
    by_size = {1: split, 8: split, 64: general, 512: packed, 4096: packed}
    planned = []
    plans = sampled_plans(samples, lambda s: planned.append(s) or by_size[s])
    assert plans == [split, split, general, packed, packed] and sorted(planned) == samples
    found = ranges("n", samples, plans, general)
    assert [(c, s) for c, s, _ in found] == [(SizeRange("n", None, 8), 8), (SizeRange("n", 65, None, 8), 4096)]
    assert found[1][0].text() == "n >= 65 and n % 8 == 0"
    assert found[1][0].holds(4096) and not found[1][0].holds(4100) and not found[1][0].holds(64)
    assert found[1][0].holds_within(1, 72) and not found[1][0].holds_within(1, 71)
    assert not SizeRange("n", 3, 5, 8).holds_within(None, None) and SizeRange("n", None, 8, 8).holds_within(2, None)


def test_adjoining_variants_of_the_same_code_are_one():
    split = _plan(threads=256, split=10, scheme="row-split")
    few, more = Variant(SizeRange("n", None, 8), split, 8), Variant(SizeRange("n", 9, 64), split, 64)
    packed = Variant(SizeRange("n", 513, None, 8), _plan(rows_per_task=8), 4096)
    assert merged((few, more, packed)) == (Variant(SizeRange("n", None, 64), split, 64), packed)
    apart = Variant(SizeRange("n", 10, 64), split, 64)  # n = 9 is between them: not joined
    assert merged((few, apart)) == (few, apart)


def test_no_kernel_is_modeled_below_one_launch_and_one_dram_round_trip():
    spec = TargetSpec.from_target(tvm.target.Target(CUDA))
    geometries = [KernelGeometry("tiny", 1, 32, loads=((4, 1),), stores=((4, 1),), load_sites=1, load_phases=1),
                  KernelGeometry("wide", 4096, 256, loads=((16, 8),), stores=((16, 1),), load_sites=8, load_phases=2,
                                 barriers=3),
                  KernelGeometry("store", 64, 128, stores=((4, 1),))]
    for geometry in geometries:
        time = kernel_time(geometry, spec)
        assert time.us >= least_us([time], spec)
    loading, storing = (kernel_time(g, spec) for g in (geometries[0], geometries[2]))
    assert least_us([loading], spec) == spec.launch_us + spec.dram_latency_us
    assert least_us([storing], spec) == spec.launch_us


def test_short_rows_run_packed_at_many_rows_and_one_per_block_at_few(monkeypatch):
    chosen_at = []
    timed = module_pass.choose_in_time
    monkeypatch.setattr("tvm_stitch.stitch.module_pass.choose_in_time",
                        lambda func, rule, spec, *prices: chosen_at.append(rule.mapping.rows)
                        or timed(func, rule, spec, *prices))
    symbolic = build(_softmax([N, 32], upper=1 << 20), CUDA, stitched=True)
    # The kernel's own plan, then the packed range's at 2^20; the 2-rows-per-block range planned at
    # n = 512 is not searched: one row per block is modeled there at one launch and one DRAM round trip.
    assert chosen_at == [-1, 1 << 20]
    (group,) = symbolic.report.groups
    (condition, packed), (otherwise, general) = group.variants
    assert packed.mapping.rows_per_task == 8 and "n % 8 == 0" in condition and otherwise == "otherwise"
    assert general.mapping.rows_per_task == 1 and general is group.plan
    _as_static_build(symbolic, 750_000, 32)
    _as_static_build(symbolic, 64, 32)
    assert count_launches(symbolic.lowered, symbolic.executable) == 1  # the variant at the upper bound
    assert re.search(r"n >= \d+ and n % 8 == 0: row-resident, 8 row/blk x 32 thr", symbolic.report.table())


def test_few_long_rows_run_row_split():
    symbolic = build(_softmax([N, 30000], upper=4096), CUDA, stitched=True)
    (group,) = symbolic.report.groups
    # The plan chosen at m = 64 (10 chunks per row) is modeled at m = 8 within TIE of the rule plan
    # there (12 chunks): it serves every m <= 64, with no timed choice made at m = 8. Above the sample
    # it still beats one row per block at m = 128, not at 256: it serves every m <= 128.
    assert [(c, p.scheme) for c, p in group.variants] == [("n <= 128", "row-split"), ("otherwise", "row-resident")]
    assert group.variants[0][1].mapping.split == 10
    _as_static_build(symbolic, 64, 30000)
    for rows in (64, 100):
        chosen = branch_at(kernel_with(symbolic, ATTR), {"n": rows})
        assert len(_launches_and_bytes(chosen, symbolic.report.spec)[0]) == 2  # partials, then the combine


@pytest.mark.parametrize("shape, upper, sizes", [
    ([N, 32], 1 << 16, [1, 7, 100, 513, 520, 1024, 4096]),  # one row per block (and n % 8 != 0), packed
    ([N, 16384], 512, [1, 9, 64, 65, 67, 70, 130]),  # row-split for few rows, then one row per block
], ids=["short-rows", "long-rows"])
def test_every_variant_matches_numpy_on_llvm(shape, upper, sizes, rng):
    built = build(_softmax(shape, upper), {"kind": "llvm"}, stitched=True, emulate="cuda")
    (group,) = built.report.groups
    assert len(group.variants) >= 2, built.report.table()
    assert {condition for condition, _ in group.variants} != {"otherwise"}
    for size in sizes:
        x = rng.standard_normal((size, shape[1])).astype("float32")
        np.testing.assert_allclose(run_cpu(built.executable, [x])[0], np_softmax(x), rtol=1e-5, atol=1e-7)


def test_one_plan_for_every_size_builds_no_variant():
    built = build(_softmax([N, 768], upper=16), CUDA, stitched=True)
    assert built.report.groups[0].variants == () and built.report.groups[0].stitched
    assert not any(ATTR in (f.attrs or {}) for _, f in built.lowered.functions_items() if isinstance(f, tirx.PrimFunc))


def test_variants_that_do_not_build_fall_back_to_the_plan_for_every_size(monkeypatch, rng):
    def broken(*_args):
        raise ValueError("no dispatch")

    monkeypatch.setattr("tvm_stitch.stitch.kernel_maker.dispatching", broken)
    built = build(_softmax([N, 32], upper=1 << 16), {"kind": "llvm"}, stitched=True, emulate="cuda")
    assert built.report.groups[0].variants == () and built.report.groups[0].plan.mapping.rows_per_task == 1
    assert any("size variants not built" in note for note in built.report.notes)
    x = rng.standard_normal((520, 32)).astype("float32")
    np.testing.assert_allclose(run_cpu(built.executable, [x])[0], np_softmax(x), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("shape, upper, sizes, oclgrind", [
    ([N, 32], 1 << 20, [1, 7, 100, 520, 4096, 16384], False),
    ([N, 30000], 4096, [1, 3, 8, 9, 33, 64, 65, 100], False),
    ([N, 32], 1 << 20, [3, 5, 9, 520, 1024, 2048], True),
], ids=["short-rows-pocl", "long-rows-pocl", "short-rows-oclgrind"])
def test_every_variant_runs_with_simt_semantics(shape, upper, sizes, oclgrind):
    import tvm_stitch.simt

    report = tvm_stitch.simt.check(_softmax(shape, upper), sizes={"n": sizes}, oclgrind=oclgrind)
    (kernel,) = report.kernels
    assert report.ok and "size variants" in kernel.detail and len(kernel.sizes) == len(sizes), kernel


@pytest.mark.slow
@needs_nvcc
def test_variants_compile_with_nvcc_without_spills(tmp_path):
    for case, (shape, upper) in {"short": ([N, 32], 1 << 20), "long": ([N, 30000], 4096)}.items():
        built = build(_softmax(shape, upper), CUDA, stitched=True)
        report = nvcc(cuda_source(built.executable), tmp_path, name=case)
        kernels = sum(plan.kernels for _, plan in built.report.groups[0].variants)
        assert len(re.findall(r"Compiling entry function", report)) == kernels
        assert all(int(n) == 0 for n in re.findall(r"(\d+) bytes spill stores", report)), report
