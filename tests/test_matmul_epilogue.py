"""Copies after a matmul, and transposes before one, join its kernel on CUDA; dlight's Matmul rule still
schedules it; numerics hold."""

import numpy as np
import tvm
from tvm import relax

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.rewrites.matmul_epilogue import RelabelMatmulEpilogues, copy_kind
from tvm_stitch.rewrites.matmul_prologue import FoldProloguesIntoMatmuls
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import launches_by_kind, primfunc_calls

from conftest import CUDA, legalized, make_module, static_shape, tensor

B, T, HEADS, D = 2, 8, 2, 16
HIDDEN = HEADS * D


def _attention_and_mlp():
    """Head split (reshape, transpose) with scale, head merge (transpose, reshape), GELU behind reshapes."""
    x = tensor("x", (B * T, HIDDEN))
    wq, wk, wv = (tensor(name, (HIDDEN, HIDDEN)) for name in ("wq", "wk", "wv"))
    w1, w2 = tensor("w1", (HIDDEN, 4 * HIDDEN)), tensor("w2", (4 * HIDDEN, HIDDEN))
    op = relax.op

    def heads(bb, h):
        return bb.emit(op.permute_dims(op.reshape(h, (B, T, HEADS, D)), [0, 2, 1, 3]))

    def body(bb, x, wq, wk, wv, w1, w2):
        q = heads(bb, op.matmul(x, wq))
        q = bb.emit(op.multiply(q, relax.const(0.25)))
        k = bb.emit(op.permute_dims(heads(bb, op.matmul(x, wk)), [0, 1, 3, 2]))
        v = heads(bb, op.matmul(x, wv))
        att = bb.emit(op.matmul(q, k))
        o = bb.emit(op.matmul(att, v))
        merged = bb.emit(op.reshape(op.permute_dims(o, [0, 2, 1, 3]), (B * T, HIDDEN)))
        u = bb.emit(op.reshape(op.matmul(merged, w1), (B, T, 4 * HIDDEN)))
        act = bb.emit(op.reshape(op.multiply(u, op.sigmoid(u)), (B * T, 4 * HIDDEN)))
        return bb.emit(op.add(op.matmul(act, w2), x))

    def numpy_ref(x, wq, wk, wv, w1, w2):
        def split(h):
            return h.reshape(B, T, HEADS, D).transpose(0, 2, 1, 3)

        q, k, v = split(x @ wq) * 0.25, split(x @ wk), split(x @ wv)
        o = (q @ k.transpose(0, 1, 3, 2)) @ v
        u = o.transpose(0, 2, 1, 3).reshape(B * T, HIDDEN) @ w1
        return (u / (1 + np.exp(-u))) @ w2 + x

    return make_module([x, wq, wk, wv, w1, w2], body), numpy_ref


def _relabelled(mod):
    return RelabelMatmulEpilogues()(legalized(mod))


def test_copy_kinds_come_from_the_tir():
    mod = legalized(_attention_and_mlp()[0])
    kinds = {gv.name_hint: copy_kind(f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert kinds["transpose"] == "transpose"
    assert kinds["reshape"] == "reshape"
    assert kinds["matmul"] == "" and kinds["multiply"] == ""


def test_copies_after_a_matmul_are_relabelled_but_the_head_merge_reshape_is_not():
    mod = _relabelled(_attention_and_mlp()[0])
    calls = primfunc_calls(mod)
    relabelled = {name for name in calls if name.endswith("_epilogue")}
    for name in relabelled:
        assert int(mod[name].attrs["op_pattern"]) == 0
        assert int(mod[name[: -len("_epilogue")]].attrs["op_pattern"]) == 2
    # Head split (reshape, transpose) of q, k and v, k's transpose for the scores, the merge's
    # transpose, the MLP's two reshapes.
    assert sum(calls[name] for name in relabelled) == 10
    # The head merge: a reshape of a transpose's output keeps its injective label.
    merge = [name for name in calls if name.startswith("reshape") and not name.endswith("_epilogue")]
    assert len(merge) == 1 and calls[merge[0]] == 1


def test_cuda_epilogues_leave_no_memory_launch_and_matmul_rule_schedules_every_matmul():
    mod, _ = _attention_and_mlp()
    stitched = build(mod, CUDA, stitched=True)
    default = build(mod, CUDA, stitched=False)
    memory, compute = launches_by_kind(stitched.lowered, stitched.executable)
    default_memory, default_compute = launches_by_kind(default.lowered, default.executable)
    assert memory == 0 < default_memory
    assert compute == default_compute == 7
    for name in primfunc_calls(stitched.lowered):
        func = stitched.lowered[name]
        if is_compute_kernel(func):
            assert str(func.attrs["tvm_stitch.schedule_rule"]) == "Matmul", name


def test_fused_epilogues_match_numpy_on_llvm(rng):
    mod, numpy_ref = _attention_and_mlp()
    fused = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])(_relabelled(mod))
    assert any("_epilogue" in gv.name_hint and "matmul" in gv.name_hint for gv in fused.get_global_vars())
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") * 0.5 for v in mod["main"].params]
    vm = relax.VirtualMachine(tvm.compile(fused, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()
    np.testing.assert_allclose(out, numpy_ref(*[a.astype(np.float64) for a in inputs]), rtol=1e-4, atol=1e-4)


def _weight_gradients():
    """dW = x^T @ dy (x^T feeds only the matmul); a transpose of a transpose; a transpose also doubled;
    a matmul of a scaled input (arithmetic, not a copy: it stays a kernel)."""
    x, dy = tensor("x", (B * T, HIDDEN)), tensor("dy", (B * T, 2 * HIDDEN))
    w, v = tensor("w", (2 * HIDDEN, HIDDEN)), tensor("v", (HIDDEN, HIDDEN))
    op = relax.op

    def body(bb, x, dy, w, v):
        dw = bb.emit(op.matmul(op.permute_dims(x, [1, 0]), dy))
        twice = bb.emit(op.matmul(op.permute_dims(op.permute_dims(dy, [1, 0]), [1, 0]), w))
        vt = bb.emit(op.permute_dims(v, [1, 0]))
        kept = bb.emit(op.matmul(x, vt))
        scaled = bb.emit(op.matmul(op.multiply(x, relax.const(3.0)), v))
        return bb.emit(relax.Tuple([dw, twice, kept, op.multiply(vt, relax.const(2.0)), scaled]))

    def numpy_ref(x, dy, w, v):
        return [x.T @ dy, dy @ w, x @ v.T, 2 * v.T, (3 * x) @ v]

    return make_module([x, dy, w, v], body), numpy_ref


def test_copies_feeding_only_matmuls_fold_into_them():
    mod = FoldProloguesIntoMatmuls(CUDA)(legalized(_weight_gradients()[0]))
    calls = primfunc_calls(mod)
    prologues = [name for name in calls if name.endswith("_prologue")]
    assert sum(calls[name] for name in prologues) == 2  # x^T's matmul, the chain's matmul (folded twice)
    kept = [name for name in calls if name.startswith("transpose")]
    assert len(kept) == 1 and calls[kept[0]] == 1  # v^T: also doubled, so kept
    assert sum(calls[name] for name in calls if name.startswith("multiply")) == 2  # 3 * x and 2 * v^T stay
    for name in prologues:
        assert int(mod[name].attrs["op_pattern"]) == 4 and is_compute_kernel(mod[name])


def test_folded_copies_match_numpy_on_llvm_and_leave_one_cuda_copy(rng):
    mod, numpy_ref = _weight_gradients()
    fused = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])(
        FoldProloguesIntoMatmuls(CUDA)(legalized(mod)))
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") for v in mod["main"].params]
    vm = relax.VirtualMachine(tvm.compile(fused, target="llvm"), tvm.cpu())
    outs = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    for out, ref in zip(outs, numpy_ref(*[a.astype(np.float64) for a in inputs])):
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
    stitched = build(mod, CUDA, stitched=True)
    default = build(mod, CUDA, stitched=False)
    memory, compute = launches_by_kind(stitched.lowered, stitched.executable)
    default_memory, default_compute = launches_by_kind(default.lowered, default.executable)
    assert memory <= 2 < default_memory  # v^T with its doubling, 3 * x (maybe packed into one)
    assert compute == default_compute == 4
    for name in primfunc_calls(stitched.lowered):
        if is_compute_kernel(stitched.lowered[name]):
            assert str(stitched.lowered[name].attrs["tvm_stitch.schedule_rule"]) == "Matmul", name


def test_split_outputs_feeding_only_matmuls_fold_into_them(rng):
    """GPT-2's fused qkv projection: split, then per-head copies, then the attention matmuls."""
    x, w = tensor("x", (B * T, HIDDEN)), tensor("w", (HIDDEN, 3 * HIDDEN))
    op = relax.op

    def heads(h):
        return op.permute_dims(op.reshape(h, (B, T, HEADS, D)), [0, 2, 1, 3])

    def body(bb, x, w):
        qkv = bb.emit(op.split(op.matmul(x, w), 3, axis=1))
        q, k, v = (bb.emit(heads(relax.TupleGetItem(qkv, i))) for i in range(3))
        return bb.emit(op.matmul(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])), v))

    mod = make_module([x, w], body)
    folded = FoldProloguesIntoMatmuls(CUDA)(legalized(mod))
    calls = primfunc_calls(folded)
    assert not [name for name in calls if name.startswith("split")]
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") for v in mod["main"].params]
    fused = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])(folded)
    vm = relax.VirtualMachine(tvm.compile(fused, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()
    qkv = inputs[0] @ inputs[1]
    q, k, v = (qkv[:, i * HIDDEN:(i + 1) * HIDDEN].reshape(B, T, HEADS, D).transpose(0, 2, 1, 3) for i in range(3))
    np.testing.assert_allclose(out, (q @ k.transpose(0, 1, 3, 2)) @ v, rtol=1e-4, atol=1e-3)
    stitched = build(mod, CUDA, stitched=True)
    assert launches_by_kind(stitched.lowered, stitched.executable) == (0, 3)


def test_rotary_embedding_folds_into_the_attention_matmul_but_an_elementwise_product_does_not(rng):
    """q * cos + rotate_half(q) * sin (slices, negation, concat: a gather) before q @ k^T folds; the
    SwiGLU product silu(g) * u before the down projection stays for the gate matmul's epilogue."""
    q, k = tensor("q", (B, HEADS, T, D)), tensor("k", (B, HEADS, D, T))
    g, u, w = tensor("g", (T, 2 * D)), tensor("u", (T, 2 * D)), tensor("w", (2 * D, D))
    op = relax.op
    cos, sin = (rng.standard_normal((T, D)).astype("float32") for _ in range(2))

    def body(bb, q, k, g, u, w):
        half = D // 2
        rotated = op.concat([op.negative(op.strided_slice(q, [3], [half], [D])), op.strided_slice(q, [3], [0], [half])],
                            axis=3)
        roped = bb.emit(op.add(op.multiply(q, relax.const(cos)), op.multiply(rotated, relax.const(sin))))
        scores = bb.emit(op.matmul(roped, k))
        down = bb.emit(op.matmul(op.multiply(op.multiply(g, op.sigmoid(g)), u), w))
        return bb.emit(relax.Tuple([scores, down]))

    mod = make_module([q, k, g, u, w], body)
    folded = FoldProloguesIntoMatmuls(CUDA)(legalized(mod))
    calls = primfunc_calls(folded)
    assert not [name for name in calls if name.startswith(("concatenate", "strided_slice", "add"))]
    assert sum(calls[name] for name in calls if name.startswith("multiply")) == 2  # the SwiGLU pair
    inputs = [rng.standard_normal(static_shape(v)).astype("float32") for v in mod["main"].params]
    fused = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])(folded)
    vm = relax.VirtualMachine(tvm.compile(fused, target="llvm"), tvm.cpu())
    scores, down = (o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))
    qn, kn, gn, un, wn = inputs
    rot = np.concatenate([-qn[..., D // 2:], qn[..., :D // 2]], axis=-1)
    np.testing.assert_allclose(scores, (qn * cos + rot * sin) @ kn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(down, (gn / (1 + np.exp(-gn)) * un) @ wn, rtol=1e-4, atol=1e-4)


def test_a_copy_dlight_matmul_would_not_schedule_with_the_matmul_stays_and_is_reported():
    # A vector-matrix product (expand_dims then matmul): dlight's Matmul rule refuses the pair.
    from tvm_stitch.report import StitchReport

    x, w = tensor("x", (4 * D,)), tensor("w", (4 * D, D))
    mod = make_module([x, w], lambda bb, x, w: bb.emit(relax.op.matmul(relax.op.expand_dims(x, 0), w)))
    report = StitchReport()
    calls = primfunc_calls(FoldProloguesIntoMatmuls(CUDA, report)(legalized(mod)))
    assert "expand_dims" in calls and not [name for name in calls if name.endswith("_prologue")]
    assert any("expand_dims stays a kernel" in note for note in report.notes)


def test_each_distinct_chain_is_composed_and_tried_once(monkeypatch, rng):
    """Two layers' rotary embeddings before q @ k^T: one FuseTIR composition and one dlight trial
    serve both (the layers share their PrimFuncs), not one per producer per round."""
    import tvm_stitch.rewrites.matmul_prologue as prologue

    counts = {"composed": 0, "trials": 0}

    def counted(name, inner):
        def wrapper(*args):
            counts[name] += 1
            return inner(*args)
        return wrapper

    monkeypatch.setattr(prologue, "compose_calls", counted("composed", prologue.compose_calls))
    monkeypatch.setattr(prologue, "matmul_rule_applies", counted("trials", prologue.matmul_rule_applies))
    qs = [tensor(f"q{i}", (B, HEADS, T, D)) for i in range(2)]
    ks = [tensor(f"k{i}", (B, HEADS, D, T)) for i in range(2)]
    op = relax.op
    cos, sin = (relax.const(rng.standard_normal((T, D)).astype("float32")) for _ in range(2))

    def body(bb, q0, q1, k0, k1):
        scores = []
        for q, k in ((q0, k0), (q1, k1)):
            half = D // 2
            rotated = op.concat([op.negative(op.strided_slice(q, [3], [half], [D])),
                                 op.strided_slice(q, [3], [0], [half])], axis=3)
            roped = op.add(op.multiply(q, cos), op.multiply(rotated, sin))
            scores.append(bb.emit(op.matmul(op.permute_dims(op.reshape(roped, (B, HEADS, T, D)), [0, 1, 2, 3]), k)))
        return bb.emit(relax.Tuple(scores))

    folded = FoldProloguesIntoMatmuls(CUDA)(legalized(make_module(qs + ks, body)))
    calls = primfunc_calls(folded)
    assert list(calls) == [name for name in calls if name.endswith("_prologue")] and sum(calls.values()) == 2
    assert counts == {"composed": 1, "trials": 1}
