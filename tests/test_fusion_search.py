"""The fusion search (fusion="search") on Relax graphs: cheaper plans than greedy's where the greedy order
cuts badly, the same plan where it does not, and kernels that compute the right answer."""

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch.grouping.fusion_search import AT_BOUND, ONE_LAUNCH, UNPRICED
from tvm_stitch.tools.build import build, cuda_launches, run_cpu

from conftest import make_module, opencl_device, tensor

op = relax.op
CUDA = {"kind": "cuda", "arch": "sm_90"}


def _producer_read_by_row_and_column_sums(rows=4096, cols=1024):
    def body(bb, x):
        p = bb.emit(op.multiply(op.exp(x), x))
        return relax.Tuple([bb.emit(op.sum(p, axis=[1])), bb.emit(op.sum(p, axis=[0]))])
    return make_module([tensor("x", (rows, cols))], body)


def _centred_square_column_sum(rows=128, cols=32768):
    def body(bb, x):
        m = bb.emit(op.mean(x, axis=[1], keepdims=True))
        d = bb.emit(op.subtract(x, m))
        return bb.emit(op.sum(op.multiply(d, d), axis=[0]))
    return make_module([tensor("x", (rows, cols))], body)


def _search_line(report):
    (record,) = report.searches
    return record


def test_producer_read_by_row_and_column_sums_is_computed_again_in_both():
    mod = _producer_read_by_row_and_column_sums()
    greedy = tvm_stitch.explain(mod, CUDA, fusion="greedy")
    search = tvm_stitch.explain(mod, CUDA)  # the search is the default
    assert not greedy.searches
    record = _search_line(search)
    greedy_us = sum(p.modeled_us for p in greedy.plans)
    assert record.method == "search" and record.proven
    assert record.greedy_us == pytest.approx(greedy_us, rel=1e-6)
    assert sum(p.modeled_us for p in search.plans) == pytest.approx(record.chosen_us, rel=1e-6)
    assert record.chosen_us < 0.85 * greedy_us
    # neither kernel writes the 16.8 MB product (nor reads it back): each reads x once, 33.6 MB against 50.3
    assert sum(p.modeled_bytes for p in search.plans) < 0.7 * sum(p.modeled_bytes for p in greedy.plans)
    assert all(g.recomputed for g in search.groups)
    assert any("computed again" in note for note in search.notes)
    assert "fusion search in main block 0" in search.table()


def test_centred_square_column_sum_launches_two_kernels_and_the_search_is_faster():
    # greedy: the mean with the square in a row-split plan (one launch: each row's last block finishes it),
    # then the column sum; the search: a row-resident kernel, then the column sum
    mod = _centred_square_column_sum()
    greedy = tvm_stitch.explain(mod, CUDA, fusion="greedy")
    search = tvm_stitch.explain(mod, CUDA)
    assert sum(p.kernels for p in greedy.plans) == 2
    assert [p.mapping.last_block_rows for p in greedy.plans if p.scheme == "row-split"] == [True]
    assert sum(p.kernels for p in search.plans) == 2
    record = _search_line(search)
    assert record.method == "search" and record.chosen_us < 0.8 * record.greedy_us


@pytest.mark.slow
def test_searched_plan_launches_two_cuda_kernels():
    assert cuda_launches(_centred_square_column_sum(), True, fusion="search") == 2


@pytest.mark.parametrize("emulate", [pytest.param(None, marks=pytest.mark.slow), "cuda"])
def test_searched_kernels_match_numpy(rng, emulate):
    x = rng.standard_normal((4096, 1024)).astype("float32")
    # fast_math off: the CUDA plans (exp, not the CPU's fast_exp, which the model prices higher)
    built = build(_producer_read_by_row_and_column_sums(), {"kind": "llvm"}, stitched=True, emulate=emulate,
                  fusion="search", fast_math=False)
    rows, cols = run_cpu(built.executable, [x])
    p = np.exp(x.astype("float64")) * x
    np.testing.assert_allclose(rows, p.sum(1), rtol=2e-4)
    np.testing.assert_allclose(cols, p.sum(0), rtol=2e-4)
    # the CPU's proxy prices traffic, not arithmetic: it never computes exp twice (greedy's plan stays)
    assert _search_line(built.report).method == ("search" if emulate else "greedy")
    y = rng.standard_normal((128, 32768)).astype("float32")
    built = build(_centred_square_column_sum(), {"kind": "llvm"}, stitched=True, emulate=emulate, fusion="search",
                  fast_math=False)
    assert _search_line(built.report).method == "search"
    (out,) = run_cpu(built.executable, [y])
    d = y.astype("float64") - y.mean(1, keepdims=True)
    np.testing.assert_allclose(out, (d * d).sum(0), rtol=2e-4)


def test_a_layernorm_keeps_greedys_one_kernel_without_a_search():
    def body(bb, x, g, b):
        mean = bb.emit(op.mean(x, axis=[-1], keepdims=True))
        xc = bb.emit(op.subtract(x, mean))
        var = bb.emit(op.mean(op.multiply(xc, xc), axis=[-1], keepdims=True))
        return bb.emit(op.add(op.multiply(op.multiply(xc, op.rsqrt(op.add(var, relax.const(1e-5)))), g), b))
    for rows, why in ((4096, AT_BOUND), (8, ONE_LAUNCH)):
        mod = make_module([tensor("x", (rows, 768)), tensor("g", (768,)), tensor("b", (768,))], body)
        report = tvm_stitch.explain(mod, CUDA)
        record = _search_line(report)
        # settled before the block is opened: no candidate is enumerated or priced
        assert (record.method, record.why, record.candidates) == ("greedy", why, 0)
        assert record.chosen_us == record.greedy_us == pytest.approx(report.plans[0].modeled_us)
        assert record.proven == (why == ONE_LAUNCH)
        assert len(report.plans) == 1


def test_a_kernel_without_modeled_time_keeps_greedys_plan_unsearched():
    n = tvm.tirx.Var("n", "int64")

    def body(bb, x):
        return bb.emit(op.sum(op.multiply(op.exp(x), x), axis=[1]))
    record = _search_line(tvm_stitch.explain(make_module([tensor("x", (n, 1024))], body), CUDA))
    assert (record.method, record.why, record.candidates, record.greedy_us) == ("greedy", UNPRICED, 0, -1.0)


@pytest.mark.parametrize("seeds", [range(3), pytest.param(range(3, 40), marks=pytest.mark.slow)])
def test_fuzzers_graphs_searched_plan_is_never_above_greedys_modeled_time(seeds):
    from tvm_stitch.planning.spec import TargetSpec
    from tvm_stitch.target import as_target
    from tvm_stitch.tools.fuzz import build_module, random_spec
    from tvm_stitch.tools.module_time import stitched_module_time

    spec = TargetSpec.from_target(as_target(CUDA))
    priced = 0
    for seed in seeds:
        mod = build_module(random_spec(seed))
        times = {f: stitched_module_time(mod, CUDA, spec, f) for f in ("greedy", "search")}
        if times["greedy"].us > 0:
            assert times["search"].us <= times["greedy"].us * (1 + 1e-9), seed
            priced += 1
    assert priced


def test_an_unknown_fusion_method_is_refused():
    with pytest.raises(ValueError, match="fusion must be one of"):
        tvm_stitch.pipeline({"kind": "llvm"}, fusion="optimal")


def test_opening_fuseops_groups_gives_one_binding_per_operator_and_keeps_the_result_variable():
    from tvm_stitch.grouping.unfuse import opened_block

    from conftest import fused

    mod = fused(_centred_square_column_sum(128, 256))
    (block,) = mod["main"].body.blocks
    opened, origin = opened_block(mod, block, {b.var for b in block.bindings})
    calls = [b for b in opened.bindings if isinstance(b.value, relax.Call)]
    assert all(b.value.op.same_as(tvm.ir.Op.get("relax.call_tir")) for b in calls)
    assert len(opened.bindings) > len(block.bindings)
    assert {b.var for b in block.bindings} <= {b.var for b in opened.bindings}
    assert set(origin.values()) == {b.var for b in block.bindings}


@pytest.mark.slow
@pytest.mark.parametrize("make", [_producer_read_by_row_and_column_sums, _centred_square_column_sum])
def test_searched_kernels_under_simt_and_nvcc_without_spills(make, tmp_path):
    import re

    from tvm_stitch import simt
    from tvm_stitch.tools.launches import cuda_source

    from conftest import NVCC, nvcc

    opencl_device(False)
    mod = make()
    report = simt.check(mod, fusion="search")
    assert report.ok and report.kernels, str(report)
    assert _search_line(report.stitch).method == "search"
    if NVCC is not None:
        built = build(mod, CUDA, stitched=True, fusion="search")
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", nvcc(cuda_source(built.executable), tmp_path))]
        assert spills and max(spills) == 0
