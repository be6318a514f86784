"""Symbolic row lengths with an upper bound are planned on CUDA as static rows of the bound.

Softmax over a key length `s <= 128` keeps its row on chip (cached input, exp in
shared memory, sized for 128) with loops to 128 under a guard `i < s`: right at
every length within the bound, one read and one write per element like the
static build at s = 128; RMSNorm, LayerNorm and masked softmax alike. Without a
bound, or with one for which no row-sized part stays on chip, the row streams as
before.
"""

import re
from dataclasses import dataclass

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.size_bounds import at_sizes
from tvm_stitch.planning import row_resident
from tvm_stitch.planning.common import block_threads
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches, cuda_source

from conftest import make_module, needs_nvcc, nvcc, opencl_device, tensor

CUDA = {"kind": "cuda", "arch": "sm_90"}
S, H, B = (tirx.Var(name, "int64") for name in ("s", "h", "b"))


def _bounded(mod, lower: dict, upper: dict):
    mod["main"] = mod["main"].with_attrs({"tir_var_lower_bound": lower, "tir_var_upper_bound": upper})
    return mod


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attention_softmax(shape):
    return make_module([tensor("x", shape)],
                       lambda bb, x: relax.op.nn.softmax(bb.emit(relax.op.multiply(x, relax.const(0.125))), axis=-1))


def _scaled_softmax_module(bound: int | None):
    mod = _attention_softmax([4, S, S])
    return _bounded(mod, {"s": 2}, {"s": bound}) if bound is not None else mod


def _masked_softmax_module():
    def body(bb, x, mask):
        scaled = bb.emit(relax.op.multiply(x, relax.const(0.125)))
        return relax.op.nn.softmax(bb.emit(relax.op.add(scaled, mask)), axis=-1)
    return _bounded(make_module([tensor("x", [2, 2, S, S]), tensor("mask", [2, 1, 1, S])], body),
                    {"s": 2}, {"s": 64})


def _layer_norm_module():
    def body(bb, x, gamma, beta):
        return relax.op.nn.layer_norm(x, gamma, beta, axes=[-1])
    return _bounded(make_module([tensor("x", [6, H]), tensor("g", [H]), tensor("b", [H])], body),
                    {"h": 2}, {"h": 256})


def _layer_norm(x, g, b):
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * g + b


def _rms_norm_module():
    # a symbolic hidden size and a symbolic row count, both bounded
    def body(bb, x, gamma):
        mean_square = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=-1, keepdims=True))
        return relax.op.multiply(relax.op.divide(x, relax.op.sqrt(relax.op.add(mean_square, relax.const(1e-6)))),
                                 gamma)
    return _bounded(make_module([tensor("x", [B, H]), tensor("g", [H])], body), {"h": 1, "b": 1},
                    {"h": 512, "b": 64})


def _centred_over_a_sequence_module():
    # the row is (s, 64): a reduction over two axes, one of them symbolic
    def body(bb, x):
        return relax.op.subtract(x, bb.emit(relax.op.mean(x, axis=[1, 2], keepdims=True)))
    return _bounded(make_module([tensor("x", [B, S, 64])], body), {"s": 1}, {"s": 64})


def _short_rows_module():
    # 64 x 64 static rows of at most 16 elements: packed 16 rows per block, as static rows of 16 are
    return _bounded(_attention_softmax([64, 64, S]), {"s": 1}, {"s": 16})


@dataclass(frozen=True)
class Case:
    module: object  # () -> the Relax module, its sizes bounded
    bound: int  # of the row's symbolic size
    row: int  # elements of a row at the bound
    inputs: object  # (rng, length) -> the inputs at that length
    reference: object  # numpy
    lengths: tuple  # within the bound: its lower end, an odd length, the bound


CASES = {
    "softmax": Case(lambda: _scaled_softmax_module(128), 128, 128,
                    lambda rng, n: [rng.standard_normal((4, n, n)).astype("float32")],
                    lambda x: _softmax(x * 0.125), (2, 37, 128)),
    "masked_softmax": Case(_masked_softmax_module, 64, 64,
                           lambda rng, n: [rng.standard_normal((2, 2, n, n)).astype("float32"),
                                           np.where(rng.random((2, 1, 1, n)) < 0.2, -1e4, 0).astype("float32")],
                           lambda x, mask: _softmax(x * 0.125 + mask), (2, 37, 64)),
    "layer_norm": Case(_layer_norm_module, 256, 256,
                       lambda rng, n: [rng.standard_normal((6, n)).astype("float32"),
                                       rng.standard_normal(n).astype("float32"),
                                       rng.standard_normal(n).astype("float32")],
                       _layer_norm, (2, 37, 256)),
    "rms_norm": Case(_rms_norm_module, 512, 512,
                     lambda rng, n: [rng.standard_normal((3, n)).astype("float32"),
                                     rng.standard_normal(n).astype("float32")],
                     lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g, (1, 7, 512)),
    "short_rows": Case(_short_rows_module, 16, 16, lambda rng, n: [rng.standard_normal((64, 64, n)).astype("float32")],
                       lambda x: _softmax(x * 0.125), (1, 7, 16)),
    "centred_over_a_sequence": Case(_centred_over_a_sequence_module, 64, 64 * 64,
                                    lambda rng, n: [rng.standard_normal((2, n, 64)).astype("float32")],
                                    lambda x: x - x.mean((1, 2), keepdims=True), (1, 9, 64)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bounded_row_is_planned_for_its_bound(case):
    case = CASES[case]
    built = build(case.module(), CUDA, stitched=True)
    assert not built.report.fallbacks, built.report.details()
    assert count_launches(built.lowered, built.executable) == 1
    plan = built.report.plans[0]
    assert plan.bounds and plan.bounds[0][1] == case.bound
    assert any("planned for its bound" in note for note in plan.notes)
    assert f"<= {case.bound}" in built.report.table()  # explain's mapping column says it
    assert "x" in plan.cached_inputs and case.row * 4 in plan.shared_rows  # the row, on chip at the bound's size
    assert plan.mapping.threads == min(block_threads(plan.spec), case.row) and plan.mapping.vector == 1
    assert plan.shared_bytes <= plan.spec.shared_bytes_per_block


@pytest.mark.parametrize("case", sorted(CASES))
def test_bounded_rows_match_numpy_at_lengths_within_the_bound(case, rng):
    case = CASES[case]
    mod = case.module()
    for emulate in (None, "cuda"):
        built = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        assert not built.report.fallbacks, built.report.details()
        for length in case.lengths:
            args = case.inputs(rng, length)
            np.testing.assert_allclose(run_cpu(built.executable, args)[0], case.reference(*args), rtol=1e-4,
                                       atol=1e-5)


def test_bounded_softmax_moves_what_the_static_build_at_the_bound_moves(monkeypatch):
    # (16, 12, s, s) scores, s <= 128: 12.6 MB at the bound, more than the L2 share the traffic model
    # lets a re-read buffer keep, so every pass over a row that is not on chip counts.
    bounded_mod = _bounded(_attention_softmax([16, 12, S, S]), {"s": 2}, {"s": 128})
    bounded = build(bounded_mod, CUDA, stitched=True).report.plans[0]
    static = build(_attention_softmax([16, 12, 128, 128]), CUDA, stitched=True).report.plans[0]
    assert bounded.bounds and any("modeled traffic at the upper bounds" in note for note in bounded.notes)
    elements = 16 * 12 * 128 * 128
    assert bounded.modeled_bytes == static.modeled_bytes == bounded.ideal_bytes == elements * 4 * 2  # 1 read, 1 write
    # The same kernel planned as for an unbounded length streams: its row is read again in each pass.
    monkeypatch.setattr(row_resident, "size_bounds", lambda func: {})
    streamed = build(bounded_mod, CUDA, stitched=True).report.plans[0]
    assert not streamed.bounds and streamed.modeled_bytes >= elements * 4 * 3


def test_short_bounded_rows_of_a_static_count_are_packed():
    plan = build(_short_rows_module(), CUDA, stitched=True).report.plans[0]
    assert plan.bounds == (("s", 16),) and plan.mapping.rows_per_task == 16 and plan.mapping.threads == 16
    assert any("rows packed per block" in note for note in plan.notes)


def test_unbounded_row_length_streams():
    plan = build(_scaled_softmax_module(None), CUDA, stitched=True).report.plans[0]
    assert not plan.bounds and not plan.cached_inputs and all(n <= 8 for n in plan.shared_rows)
    assert any("no upper bound" in note for note in plan.notes)


def test_a_bound_too_large_for_a_row_on_chip_streams():
    built = build(_scaled_softmax_module(1 << 16), CUDA, stitched=True)
    assert not built.report.fallbacks, built.report.details()
    plan = built.report.plans[0]
    assert not plan.bounds and not plan.cached_inputs and all(n <= 8 for n in plan.shared_rows)
    assert any("streamed instead" in note and "s <= 65536" in note for note in plan.notes)


@needs_nvcc
def test_bounded_rows_cuda_compiles_with_static_shared_memory(tmp_path):
    for case in ("softmax", "layer_norm", "centred_over_a_sequence", "short_rows"):
        built = build(CASES[case].module(), CUDA, stitched=True)
        report = nvcc(cuda_source(built.executable), tmp_path, name=case)
        shared = [int(n) for n in re.findall(r"(\d+) bytes smem", report)]
        assert shared and max(shared) >= CASES[case].row * 4, report  # the row is in shared memory


@pytest.mark.parametrize("case,oclgrind", [(c, False) for c in sorted(CASES)] + [("softmax", True)])
def test_bounded_rows_run_with_simt_semantics_at_lengths_within_the_bound(case, oclgrind):
    """The CUDA kernel at concrete lengths (its sizes specialised): pocl compares it with the
    unscheduled PrimFunc on llvm; Oclgrind also reports any read or write out of bounds."""
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    from tvm_stitch.simt.simt_kernel import Reference, check_kernel

    device = opencl_device(oclgrind)
    case = CASES[case]
    stitched, report, fused = simt.stitched_kernels(case.module(), tvm.target.Target(CUDA))
    (plan,) = report.plans
    assert plan.bounds
    kernel, unscheduled = stitched[plan.kernel], fused[plan.kernel]
    sizes = {name for name, _ in plan.bounds} | {v.name for p in kernel.params for d in p.ty.shape
                                                  for v in tirx.analysis.undefined_vars(d)}
    # Every length for the softmax, the odd one elsewhere (each length is an OpenCL build).
    for length in case.lengths if case is CASES["softmax"] and not oclgrind else case.lengths[1:2]:
        at = {name: length if name in dict(plan.bounds) else 3 for name in sizes}
        reference = at_sizes(unscheduled, at)
        checked = check_kernel(plan.kernel, at_sizes(kernel, at),
                               [Reference(reference, tuple(range(len(reference.params))))], device, oclgrind,
                               seed=length)
        assert checked.ok, (length, checked)


def _exp_then_softmax(bb, x):
    y = bb.emit(relax.op.exp(x))
    return relax.Tuple([y, bb.emit(relax.op.nn.softmax(y, axis=-1))])


def test_a_kernel_output_read_again_stitches_with_a_bound(rng):
    # exp(x) is an output and the softmax's input: on CUDA kept in shared memory, which a row of
    # unbounded symbolic length cannot have (the group falls back); with a bound it is sized for it.
    unbounded = build(make_module([tensor("x", [4, S, S])], _exp_then_softmax), CUDA, stitched=True)
    assert unbounded.report.fallbacks
    assert unbounded.report.fallbacks[0].reason.params["row_resident"].code == "symbolic-shared-buffer"
    mod = _bounded(make_module([tensor("x", [4, S, S])], _exp_then_softmax), {"s": 1}, {"s": 128})
    bounded = build(mod, CUDA, stitched=True)
    assert not bounded.report.fallbacks and bounded.report.plans[0].bounds == (("s", 128),)
    emulated = build(mod, {"kind": "llvm"}, stitched=True, emulate="cuda")
    for length in (1, 5, 128):
        x = (rng.standard_normal((4, length, length)) * 0.3).astype("float32")
        y, z = run_cpu(emulated.executable, [x])
        np.testing.assert_allclose(y, np.exp(x), rtol=1e-5)
        np.testing.assert_allclose(z, _softmax(np.exp(x)), rtol=1e-4, atol=1e-6)


def test_a_long_bound_keeps_what_fits_as_a_static_row_would(rng):
    # s <= 8192: the exp row (32 KB) is kept in shared memory, the input's row no longer fits beside
    # it (read twice), as for a static row of 8192; s <= 16384: nothing of a row fits, it streams.
    N = tirx.Var("n", "int64")

    def module(bound):
        return _bounded(make_module([tensor("x", [N, S])], lambda bb, x: relax.op.nn.softmax(x, axis=-1)),
                        {"s": 2}, {"s": bound})

    plan = build(module(8192), CUDA, stitched=True).report.plans[0]
    assert plan.bounds == (("s", 8192),) and not plan.cached_inputs
    assert {i.name: i.level for i in plan.intermediates}["T_softmax_exp"] == "shared" and 8192 * 4 in plan.shared_rows
    emulated = build(module(8192), {"kind": "llvm"}, stitched=True, emulate="cuda")
    for length in (2, 37, 8192):
        x = rng.standard_normal((3, length)).astype("float32")
        np.testing.assert_allclose(run_cpu(emulated.executable, [x])[0], _softmax(x), rtol=1e-4, atol=1e-6)
    streamed = build(module(16384), CUDA, stitched=True).report.plans[0]
    assert not streamed.bounds and any("nothing of a row" in note for note in streamed.notes)


def test_sizes_inside_composite_extents_are_set_through_the_plain_ones():
    # BERT's head merge hands `2 * s` rows to a kernel that also reads an (s, 64) buffer: the size is
    # set through the plain extent; where it occurs only as `2 * s`, there is no modeled traffic at the
    # bound, and the group still stitches.
    from tvm.script import tirx as T

    from tvm_stitch.analysis.size_bounds import ATTR, at_upper_bounds

    @T.prim_func(private=True, s_tir=True)
    def both(a: T.handle, b: T.handle, c: T.handle):
        s = T.int64()
        A = T.match_buffer(a, (2 * s, 64))
        B = T.match_buffer(b, (s, 64))
        C = T.match_buffer(c, (2 * s, 64))
        for i, j in T.grid(2 * s, 64):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vi, vj] + B[vi % s, vj]

    @T.prim_func(private=True, s_tir=True)
    def composite(a: T.handle, c: T.handle):
        s = T.int64()
        A = T.match_buffer(a, (2 * s, 64))
        C = T.match_buffer(c, (2 * s, 64))
        for i, j in T.grid(2 * s, 64):
            with T.sblock("copy"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vi, vj]

    bounds = {"s": [2, 128]}
    func, values = at_upper_bounds(both.with_attr(ATTR, bounds))
    assert values == {"s": 128} and [int(d) for d in func.params[0].ty.shape] == [256, 64]
    assert at_upper_bounds(composite.with_attr(ATTR, bounds)) == (None, {})
