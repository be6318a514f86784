"""Cheap index-only producers (masks from `arange` of a symbolic length) are recomputed by each group
reading them instead of launching on their own (grouping/partition.py: recomputed_producers).

A mask of the sizes alone reaches the partition as one kernel of no input, `closed_form`
(rewrites/closed_forms), recomputed like any cheap producer."""

import numpy as np
from tvm import relax, tirx

import tvm_stitch
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.launches import count_launches

from conftest import make_module, tensor

S = tirx.Var("s", "int64")
CUDA = {"kind": "cuda", "arch": "sm_90"}


def _causal_mask(bb):
    pos = bb.emit(relax.op.arange(S, dtype="int64"))
    causal = bb.emit(relax.op.greater_equal(relax.op.expand_dims(pos, 1), relax.op.expand_dims(pos, 0)))
    return bb.emit(relax.op.where(causal, relax.const(0.0), relax.const(-1e9)))


def _two_masked_softmaxes(bb, x, y):
    # x and y have different row counts: two groups, both reading the mask.
    mask = _causal_mask(bb)
    return relax.Tuple([bb.emit(relax.op.nn.softmax(relax.op.add(x, mask))),
                        bb.emit(relax.op.nn.softmax(relax.op.add(y, mask)))])


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _causal(length: int) -> np.ndarray:
    return np.where(np.arange(length)[:, None] >= np.arange(length)[None, :], 0.0, -1e9)


def _check_two_masked_softmaxes(executable, rng, length: int) -> None:
    """`_two_masked_softmaxes`' outputs match numpy at one length."""
    x = rng.standard_normal((4, length, length)).astype("float32")
    y = rng.standard_normal((2, length, length)).astype("float32")
    a, b = run_cpu(executable, [x, y])
    np.testing.assert_allclose(a, _softmax(x + _causal(length)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, _softmax(y + _causal(length)), rtol=1e-5, atol=1e-6)


def test_arange_mask_read_by_two_softmaxes_has_no_launch_of_its_own(rng):
    mod = make_module([tensor("x", [4, S, S]), tensor("y", [2, S, S])], _two_masked_softmaxes)
    cuda = build(mod, CUDA, stitched=True)
    assert not cuda.report.fallbacks, cuda.report.details()
    assert count_launches(cuda.lowered, cuda.executable) == 2  # the softmaxes; the mask is in both
    recomputing = [g for g in cuda.report.groups if g.recomputed]
    assert len(recomputing) == 2 and all(g.recomputed == ("closed_form",) for g in recomputing)
    assert "recomputed in" in cuda.report.table()
    for emulate in (None, "cuda"):
        cpu = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        for length in (1, 5, 70):
            _check_two_masked_softmaxes(cpu.executable, rng, length)


def test_a_mask_the_function_returns_keeps_its_launch(rng):
    # Returned, the mask must be in memory anyway: it is computed once, not recomputed.
    def body(bb, x):
        mask = _causal_mask(bb)
        return relax.Tuple([bb.emit(relax.op.nn.softmax(relax.op.add(x, mask))), mask])

    mod = make_module([tensor("x", [4, S, S])], body)
    cuda = build(mod, CUDA, stitched=True)
    assert not [g for g in cuda.report.groups if g.recomputed]
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    x = rng.standard_normal((4, 6, 6)).astype("float32")
    mask = _causal(6)
    soft, returned = run_cpu(cpu.executable, [x])
    np.testing.assert_allclose(returned, mask)
    np.testing.assert_allclose(soft, _softmax(x + mask), rtol=1e-5, atol=1e-6)


def test_a_producer_reading_a_large_tensor_is_not_recomputed():
    # 2 * w reads a 4096-element tensor: recomputing it per use would read w again; it is grouped as usual.
    def body(bb, x, y, w):
        doubled = bb.emit(relax.op.multiply(w, relax.const(2.0)))
        return relax.Tuple([bb.emit(relax.op.nn.softmax(relax.op.add(x, doubled))),
                            bb.emit(relax.op.nn.softmax(relax.op.add(y, doubled)))])

    mod = make_module([tensor("x", [4, 64, 64]), tensor("y", [2, 64, 64]), tensor("w", [64, 64])], body)
    cuda = build(mod, CUDA, stitched=True)
    assert not [g for g in cuda.report.groups if g.recomputed]


def test_a_mask_whose_readers_fall_back_is_stitched_on_its_own(monkeypatch, rng):
    from tvm_stitch.stitch import kernel_maker

    plan_kernel = kernel_maker.plan_kernel

    def refuse_softmax(func, spec, name):
        if "softmax" in func.script():
            raise tvm_stitch.StitchError("refused for the test")
        return plan_kernel(func, spec, name)

    monkeypatch.setattr(kernel_maker, "plan_kernel", refuse_softmax)
    mod = make_module([tensor("x", [4, S, S]), tensor("y", [2, S, S])], _two_masked_softmaxes)
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    stitched = [g for g in cpu.report.groups if g.stitched]
    assert len(stitched) == 1 and stitched[0].ops == ("closed_form",) and not stitched[0].recomputed
    assert any("instead of recomputing" in note for note in cpu.report.notes)
    _check_two_masked_softmaxes(cpu.executable, rng, 9)


def _two_masked_attention_scores(bb, q, k, q2, k2):
    mask = _causal_mask(bb)
    out = []
    for a, b in ((q, k), (q2, k2)):
        scores = bb.emit(relax.op.reshape(relax.op.matmul(a, b), relax.ShapeExpr([2, 2, S, S])))
        out.append(bb.emit(relax.op.nn.softmax(relax.op.add(relax.op.multiply(scores, relax.const(0.25)), mask))))
    return relax.Tuple(out)


def test_scores_matmuls_leave_the_masked_scale_to_the_softmaxes_that_recompute_the_mask(rng):
    # matmul -> reshape -> scale -> + mask -> softmax, twice: relabelling the reshapes would pull the
    # mask's add into the matmuls' kernels, reading the mask from memory after a launch of its own.
    params = [tensor("q", [4, S, 16]), tensor("k", [4, 16, S]), tensor("q2", [4, S, 16]), tensor("k2", [4, 16, S])]
    mod = make_module(params, _two_masked_attention_scores)
    cuda = build(mod, CUDA, stitched=True)
    # two matmuls, one kernel for both masked softmaxes (siblings over the same rows recomputing one mask)
    assert count_launches(cuda.lowered, cuda.executable) == 3
    stitched = [g for g in cuda.report.groups if g.stitched]
    assert len(stitched) == 1 and stitched[0].ops.count("softmax") == 2 and "closed_form" in stitched[0].recomputed
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    inputs = [rng.standard_normal(shape).astype("float32") for shape in ((4, 5, 16), (4, 16, 5)) * 2]
    mask = _causal(5)
    outs = run_cpu(cpu.executable, inputs)
    for out, (a, b) in zip(outs, (inputs[:2], inputs[2:])):
        np.testing.assert_allclose(out, _softmax((a @ b).reshape(2, 2, 5, 5) * 0.25 + mask), rtol=1e-5, atol=1e-6)


def test_a_mask_read_through_a_tuple_of_a_constant_is_still_recomputed(rng):
    # The importers' `(const, mask)[1]` (index tensors of advanced indexing): once the pipeline
    # canonicalises the projection, the mask's readers are the softmaxes alone.
    def body(bb, x, y):
        mask = _causal_mask(bb)
        pair = bb.emit(relax.Tuple([relax.const(np.zeros(2, "float32")), mask]))
        aliased = bb.emit(relax.TupleGetItem(pair, 1))
        return relax.Tuple([bb.emit(relax.op.nn.softmax(relax.op.add(x, aliased))),
                            bb.emit(relax.op.nn.softmax(relax.op.add(y, aliased)))])

    mod = make_module([tensor("x", [4, S, S]), tensor("y", [2, S, S])], body)
    cuda = build(mod, CUDA, stitched=True)
    assert count_launches(cuda.lowered, cuda.executable) == 2  # the softmaxes; the mask is in both
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    _check_two_masked_softmaxes(cpu.executable, rng, 7)


def test_cos_and_sin_of_recomputed_angles_are_one_kernel(rng):
    # Rotary embeddings: the angles come from the positions alone; cos and sin of them, two
    # siblings over the same rows, recompute the angles once in one kernel with two outputs.
    def body(bb, _x):
        pos = relax.op.astype(relax.op.arange(S, dtype="int64"), "float32")
        angles = bb.emit(relax.op.multiply(relax.op.expand_dims(pos, 1), relax.const(np.linspace(0.1, 1.0, 16, dtype="float32"))))
        cos = bb.emit(relax.op.cos(angles))
        sin = bb.emit(relax.op.sin(angles))
        return relax.Tuple([cos, sin])

    mod = make_module([tensor("x", [2, S, 16])], body)
    cuda = build(mod, CUDA, stitched=True)
    assert not cuda.report.fallbacks, cuda.report.details()
    assert count_launches(cuda.lowered, cuda.executable) == 1
    x = rng.standard_normal((2, 5, 16)).astype("float32")
    angles = np.arange(5, dtype="float32")[:, None] * np.linspace(0.1, 1.0, 16, dtype="float32")
    for emulate in (None, "cuda"):
        cpu = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        cos, sin = run_cpu(cpu.executable, [x])
        np.testing.assert_allclose(cos, np.cos(angles), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sin, np.sin(angles), rtol=1e-5, atol=1e-6)


def test_positions_sliced_from_a_model_buffer_are_recomputed_by_the_embedding_sum(rng):
    # BERT's embeddings: position ids are a slice (to the symbolic length) of a registered buffer
    # larger than a "tiny" tensor, read over (1, s) and broadcast over the batch (rows that do not
    # align: two kernels unless the slice is recomputed), gathered from a table. A static
    # build folds the slice; a symbolic one recomputes it in the embedding sum's kernel.
    positions = relax.const(np.arange(512, dtype="int64")[None, ::-1].copy())

    def body(bb, x, table):
        ids = bb.emit(relax.op.strided_slice(positions, axes=[1], begin=[0], end=[S], assume_inbound=True))
        batch_ids = bb.emit(relax.op.broadcast_to(ids, relax.ShapeExpr([2, S])))
        return bb.emit(relax.op.add(relax.op.add(x, relax.op.take(table, batch_ids, axis=0)),
                                    relax.op.take(table, relax.op.squeeze(ids, [0]), axis=0)))

    mod = make_module([tensor("x", [2, S, 16]), tensor("table", [512, 16])], body)
    cuda = build(mod, CUDA, stitched=True)
    assert not cuda.report.fallbacks, cuda.report.details()
    assert count_launches(cuda.lowered, cuda.executable) == 1
    # the buffer counts down from 511: an affine constant, so its slice is a closed form
    assert any("closed_form" in g.recomputed for g in cuda.report.groups)
    table = rng.standard_normal((512, 16)).astype("float32")
    for emulate in (None, "cuda"):
        cpu = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate)
        for length in (2, 9):
            x = rng.standard_normal((2, length, 16)).astype("float32")
            (out,) = run_cpu(cpu.executable, [x, table])
            np.testing.assert_allclose(out, x + 2 * table[np.arange(512)[::-1][:length]][None], rtol=1e-6)
