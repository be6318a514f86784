"""On the CPU, short rows that reduce go across the vector lanes, a lane per row (rows of at most a quarter of
the lanes, or of half with two reductions): the plan says so for such rows only, the schedule leaves each row
straight-line code that LLVM vectorises across rows, and the results match numpy at static and symbolic row
counts, whole vectors of rows or not."""

import dataclasses
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build, run_cpu

from conftest import (kernel_with, layer_norm_module, make_module, np_layer_norm, np_rms_norm, np_softmax,
                      rms_norm_module, symbolic_softmax, tensor)

N = tirx.Var("n", "int64")
ZNVER4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})  # 512-bit vectors: 16 float32 lanes


def _spec(vector_bits: int) -> TargetSpec:
    """The host's spec with 2 cores and vectors of `vector_bits` (the plans the tests read)."""
    return dataclasses.replace(TargetSpec.from_target(host_target()), cores=2, vector_bytes=vector_bits // 8)


GRAPHS = {
    "softmax": (symbolic_softmax, 1, np_softmax),
    "layernorm": (layer_norm_module, 3, np_layer_norm),
    "rmsnorm": (rms_norm_module, 2, np_rms_norm),
}


def _across(mod, vector_bits: int = 512) -> bool:
    (group,) = build(mod, host_target(), stitched=True, spec=_spec(vector_bits)).report.groups
    return group.plan.mapping.across


@pytest.mark.parametrize("rows", [N, 65536])
def test_short_rows_go_across_the_lanes(rows):
    assert _across(symbolic_softmax((rows, 8)))  # 8 of 16 float32 lanes, two reductions
    assert _across(layer_norm_module((rows, 4)))
    # no vector of 4 lanes divides 5: the along plan's row loop is scalar, which LLVM vectorises across rows
    assert not _across(layer_norm_module((rows, 5)))
    assert not _across(symbolic_softmax((rows, 6)))
    assert _across(rms_norm_module((rows, 4)))  # a quarter of the lanes: one reduction is enough
    assert not _across(rms_norm_module((rows, 8)))  # half the lanes, one reduction: along each row
    assert not _across(symbolic_softmax((rows, 12)))  # more than half the lanes: along each row
    assert not _across(symbolic_softmax((rows, 16)))
    assert not _across(symbolic_softmax((rows, 32)))


def test_the_rule_follows_the_vector_width():
    assert _across(symbolic_softmax((N, 4)), vector_bits=256)  # 4 of 8 lanes
    assert not _across(symbolic_softmax((N, 8)), vector_bits=256)
    assert not _across(rms_norm_module((N, 4)), vector_bits=256)


def test_fewer_rows_than_lanes_and_rows_without_a_reduction_stay_along_the_row():
    assert not _across(symbolic_softmax((15, 8)))
    assert _across(symbolic_softmax((16, 8)))
    assert not _across(make_module([tensor("x", (N, 8))], lambda _bb, x: relax.op.exp(x)))


def test_a_row_is_straight_line_code_that_llvm_vectorises_across_rows():
    built = build(symbolic_softmax((N, 8)), ZNVER4, stitched=True, spec=_spec(512))
    assert "across rows" in built.report.table()
    kernel = kernel_with(built, "tvm_stitch.plan")
    kinds = []
    tvm_ffi.structural_walk(kernel.body, (tirx.For, lambda loop: kinds.append(loop.kind)), order="pre")
    assert kinds[0] == tirx.ForKind.PARALLEL
    assert set(kinds[1:]) == {tirx.ForKind.UNROLLED}
    module = tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")})
    asm = tvm.tirx.build(module, target=ZNVER4).inspect_source("asm")
    # lane-wise maxima and sums of 16 rows at a time: the row loop vectorised across rows
    assert re.search(r"vmaxps\s[^\n]*zmm", asm) and re.search(r"vaddps\s[^\n]*zmm", asm)


def test_kernels_with_rows_across_the_lanes_keep_their_own_row_loop():
    # packed, the row loop branches per task and LLVM's vectoriser gathers and scatters
    mod = make_module([tensor("x", (N, 8)), tensor("y", (N, 8))],
                      lambda _bb, x, y: relax.Tuple([relax.op.nn.softmax(x, -1), relax.op.nn.softmax(y, -1)]))
    built = build(mod, host_target(), stitched=True, spec=_spec(512))
    assert [g.plan.mapping.across for g in built.report.groups] == [True, True]
    assert not any(name.startswith("pack_") for name in (gv.name_hint for gv in built.lowered.get_global_vars()))
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((33, 8)).astype("float32") for _ in range(2))
    out = run_cpu(built.executable, [x, y])
    np.testing.assert_allclose(out[0], np_softmax(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], np_softmax(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, length", [("softmax", 4), ("softmax", 8), ("layernorm", 4), ("layernorm", 8),
                                          ("rmsnorm", 4)])
def test_across_rows_matches_numpy_at_static_and_symbolic_counts(name, length):
    make, inputs, reference = GRAPHS[name]
    rng = np.random.default_rng(length)
    symbolic = build(make((N, length)), host_target(), stitched=True, spec=_spec(512))
    assert symbolic.report.groups[0].plan.mapping.across
    for count in (1, 15, 17, 1000, 4099):  # a partial vector of rows, one and a bit, many and a tail
        args = [rng.standard_normal((count, length) if k == 0 else (length,)).astype("float32")
                for k in range(inputs)]
        expected = reference(*args)
        np.testing.assert_allclose(run_cpu(symbolic.executable, args)[0], expected, rtol=1e-5, atol=1e-5)
        static = build(make((count, length)), host_target(), stitched=True, spec=_spec(512))
        assert static.report.groups[0].plan.mapping.across == (count >= 16)
        np.testing.assert_allclose(run_cpu(static.executable, args)[0], expected, rtol=1e-5, atol=1e-5)
