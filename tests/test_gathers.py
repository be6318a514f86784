"""Reads through computed indices inside stitched groups: embedding lookups, rotated halves, pads, takes.

A read of a kernel input may use any index (a global load); a read of an
intermediate the plan keeps on chip must stay in its row, else the rows stop
there (one row task for a small kernel, a fallback naming the read for a large one).
"""


import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from tvm_stitch import TargetSpec
from tvm_stitch.analysis.tir_view import GATHER, POINT, REGION, block_views
from tvm_stitch.planning.common import PlanError
from tvm_stitch.planning.planner import plan_row_resident
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import cuda_source

from conftest import CUDA, LLVM, make_module, needs_nvcc, nvcc, opencl_device, tensor

R = relax.op
ROWS, VOCAB, WIDTH = 8, 20, 64
HALF = WIDTH // 2
REPEATED_IDS = np.array([3, 3, 0, 19, 7, 3, 19, 1], "int32")  # repeated ids: the same row gathered twice


def _layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma + beta


def _embedding():
    """Token plus position embeddings, positions the ids reversed (the input read at two indices)."""
    def body(bb, ids, table, positions, gamma, beta):
        tokens = bb.emit(R.take(table, ids, axis=0))
        places = bb.emit(R.take(positions, bb.emit(R.flip(ids, axis=0)), axis=0))
        return bb.emit(R.nn.layer_norm(bb.emit(R.add(tokens, places)), gamma, beta, axes=[-1]))

    mod = make_module([tensor("ids", (ROWS,), "int32"), tensor("table", (VOCAB, WIDTH)),
                       tensor("positions", (VOCAB, WIDTH)), tensor("gamma", (WIDTH,)), tensor("beta", (WIDTH,))], body)

    def inputs(rng):
        return [REPEATED_IDS] + [rng.standard_normal(s).astype("float32")
                                 for s in ((VOCAB, WIDTH), (VOCAB, WIDTH), (WIDTH,), (WIDTH,))]

    def reference(ids, table, positions, gamma, beta):
        return _layer_norm(table[ids] + positions[ids[::-1]], gamma, beta)

    return mod, inputs, reference


def _rotate_half():
    """RoPE's rotated halves of an intermediate kept on chip (exp, read three times per element)."""
    def body(bb, x, cos, sin):
        e = bb.emit(R.exp(x))
        low = bb.emit(R.strided_slice(e, axes=[1], begin=[0], end=[HALF]))
        high = bb.emit(R.strided_slice(e, axes=[1], begin=[HALF], end=[WIDTH]))
        rotated = bb.emit(R.concat([bb.emit(R.negative(high)), low], axis=1))
        return bb.emit(R.add(bb.emit(R.multiply(e, cos)), bb.emit(R.multiply(rotated, sin))))

    mod = make_module([tensor("x", (ROWS, WIDTH)), tensor("cos", (ROWS, WIDTH)), tensor("sin", (ROWS, WIDTH))], body)

    def inputs(rng):
        return [rng.standard_normal((ROWS, WIDTH)).astype("float32") for _ in range(3)]

    def reference(x, cos, sin):
        e = np.exp(x)
        return e * cos + np.concatenate([-e[:, HALF:], e[:, :HALF]], 1) * sin

    return mod, inputs, reference


def _pad_softmax():
    def body(bb, x):
        padded = bb.emit(R.nn.pad(x, (0, 0, 1, 2), pad_value=0.0))
        return bb.emit(R.nn.softmax(padded, axis=-1))

    mod = make_module([tensor("x", (ROWS, WIDTH - 3))], body)

    def inputs(rng):
        return [rng.standard_normal((ROWS, WIDTH - 3)).astype("float32")]

    def reference(x):
        e = np.exp(np.pad(x, ((0, 0), (1, 2))))
        return e / e.sum(1, keepdims=True)

    return mod, inputs, reference


def _take_of_row_sums(rows=ROWS):
    """A take of a reduction's result: a kept intermediate read across rows."""
    def body(bb, ids, x):
        sums = bb.emit(R.sum(x, axis=[1]))
        picked = bb.emit(R.reshape(bb.emit(R.take(sums, ids, axis=0)), (rows, 1)))
        return bb.emit(R.add(picked, x))

    mod = make_module([tensor("ids", (rows,), "int32"), tensor("x", (rows, WIDTH))], body)

    def inputs(rng):
        return [rng.integers(0, rows, rows).astype("int32"), rng.standard_normal((rows, WIDTH)).astype("float32")]

    def reference(ids, x):
        return x.sum(1)[ids][:, None] + x

    return mod, inputs, reference


GRAPHS = {"embedding": _embedding, "rotate_half": _rotate_half, "pad_softmax": _pad_softmax,
          "take_of_row_sums": _take_of_row_sums}


def _check(built, inputs, reference):
    (out,) = run_cpu(built.executable, inputs)
    expected = reference(*[a if a.dtype.kind in "iu" else a.astype(np.float64) for a in inputs])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("emulate", [None, "cuda"], ids=["llvm", "emulated-cuda"])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_gather_group_is_one_stitched_kernel_matching_numpy(name, emulate, rng):
    mod, inputs, reference = GRAPHS[name]()
    built = build(mod, LLVM, stitched=True, strict=True, emulate=emulate)
    assert len(built.report.plans) == 1 and not built.report.fallbacks
    _check(built, inputs(rng), reference)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_gather_kernels_are_clean_under_oclgrind(name):
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt

    opencl_device(True)
    report = simt.check(GRAPHS[name]()[0], oclgrind=True)
    assert len(report.kernels) == 1 and report.ok, str(report)


def test_rotated_halves_of_an_intermediate_stay_in_their_row():
    """The exp is kept on chip and read at [i, j + 32] and [i, j - 32]: aligned, so rows stay rows."""
    built = build(_rotate_half()[0], CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.rank == 1 and plan.aligned_depth == 1
    assert [i.name for i in plan.intermediates if not i.inlined] == ["compute"]


def test_a_take_of_a_kept_intermediate_ends_the_rows():
    """Small: one row task. Large: the fallback names the read that crosses rows."""
    built = build(_take_of_row_sums()[0], CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    assert plan.rank == 0 and plan.aligned_depth == 0
    large = build(_take_of_row_sums(rows=1 << 15)[0], CUDA, stitched=True)
    (group,) = large.report.fallbacks
    assert group.reason.code == "no-row-axis" and group.reason.params["elements"] >= 1 << 20, group.fallback
    assert "(gather access) across rows" in group.reason.params["limit"], group.fallback


def test_embedding_reads_the_table_once_per_gathered_row():
    """Modeled traffic: each gathered element once per use, the ideal no more than the rows used."""
    built = build(_embedding()[0], CUDA, stitched=True, strict=True)
    (plan,) = built.report.plans
    tables = 2 * ROWS * WIDTH * 4  # token and position rows, one per output row
    rest = ROWS * 4 + 2 * WIDTH * 4 + ROWS * WIDTH * 4  # ids, gamma and beta, the output
    assert plan.ideal_bytes == tables + rest
    assert plan.modeled_bytes <= plan.ideal_bytes + ROWS * 4  # the reversed ids: a second read of ids


@T.prim_func(s_tir=True)
def _rotate_input(x: T.Buffer((4, 8), "float32"), y: T.Buffer((4, 8), "float32")):
    for i, j in T.grid(4, 8):
        with T.sblock("rotate"):
            vi, vj = T.axis.remap("SS", [i, j])
            T.reads(x[vi, 0:8])
            T.writes(y[vi, vj])
            y[vi, vj] = T.if_then_else(vj < 4, -x[vi, vj + 4], x[vi, vj - 4])


def test_view_lists_one_gather_access_per_loaded_index():
    (view,) = block_views(tvm.s_tir.Schedule(_rotate_input))
    assert [r.kind for r in view.reads] == [GATHER, GATHER] and view.writes[0].kind == POINT
    assert [str(r.indices[1]) for r in view.reads] == ["vj + 4", "vj - 4"]
    plan = plan_row_resident(_rotate_input, TargetSpec.from_target(CUDA), "rotate")
    assert plan.rank >= 1


@T.prim_func(s_tir=True)
def _opaque_region(x: T.Buffer((4, 8), "float32"), y: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("opaque"):
            vi = T.axis.spatial(4, i)
            T.reads(x[vi, 0:8])
            T.writes(y[vi])
            y[vi] = T.call_extern("float32", "row_sum", x.access_ptr("r", offset=vi * 8))


def test_region_no_load_describes_falls_back_with_its_buffer_named():
    with pytest.raises(PlanError) as err:
        plan_row_resident(_opaque_region, TargetSpec.from_target(CUDA), "opaque")
    assert err.value.code == "region-access"
    assert err.value.params == {"block": "opaque", "role": "reads", "buffer": "x"}


@needs_nvcc
@pytest.mark.parametrize("name", list(GRAPHS))
def test_gather_kernels_compile_with_nvcc(name, tmp_path):
    built = build(GRAPHS[name]()[0], CUDA, stitched=True, strict=True)
    nvcc(cuda_source(built.executable), tmp_path)


def test_bert_embedding_with_symbolic_sequence_is_one_launch():
    """BERT's token, type and position lookups + LayerNorm over a symbolic sequence: one CUDA launch
    (the position ids' two reads stay two gathers: merged into one region they would not stitch)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tvm_stitch.tools.launches import cuda_source, kernels_per_primfunc, primfunc_calls
    from tvm_stitch.tools.models import import_model

    mod, _, _ = import_model("bert", "test", dynamic_shapes=({1: torch.export.Dim("s", min=2, max=128)},))
    built = build(mod, CUDA, stitched=True)
    (embedding,) = [g for g in built.report.groups if "take" in g.ops and "layer_norm" in g.ops]
    assert embedding.kernel, embedding.fallback
    calls = primfunc_calls(built.lowered)
    assert calls[embedding.kernel] * kernels_per_primfunc(cuda_source(built.executable), calls)[embedding.kernel] == 1
    assert not [g.fallback for g in built.report.fallbacks if "region" in g.fallback]


@T.prim_func(s_tir=True)
def _row_sum_in_body(x: T.Buffer((4, 8), "float32"), y: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("looped"):
            vi = T.axis.spatial(4, i)
            T.reads(x[vi, 0:8])
            T.writes(y[vi])
            y[vi] = T.float32(0)
            for k in range(8):
                y[vi] = y[vi] + x[vi, k]


def test_loads_inside_a_loop_of_the_body_are_a_region():
    (view,) = block_views(tvm.s_tir.Schedule(_row_sum_in_body))
    assert [r.kind for r in view.reads] == [REGION]
