"""Real models imported from PyTorch through from_torch (the test extra installs torch and transformers)."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_stitch.tools.build import build, run_cpu  # noqa: E402
from tvm_stitch.tools.launches import launches_by_kind  # noqa: E402
from tvm_stitch.tools.launches import count_launches  # noqa: E402
from tvm_stitch.tools.models import eager_outputs, import_model, make_model  # noqa: E402

import torch  # noqa: E402
import tvm  # noqa: E402

SEQUENCE = {1: torch.export.Dim("s", min=2, max=128)}
BATCH_AND_SEQUENCE = {0: torch.export.Dim("b", min=1, max=16), 1: torch.export.Dim("s", min=2, max=128)}


def _cuda_counts(mod) -> tuple:
    """({stitched: (memory-intensive, compute-intensive) CUDA launches}, the stitched build), sm_90."""
    counts = {}
    for stitched in (False, True):
        built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=stitched)
        counts[stitched] = launches_by_kind(built.lowered, built.executable)
    return counts, built


def _fused_attentions(built) -> int:
    """Attention chains the build made one kernel each (rewrites/attention.py)."""
    return sum(record.fused for record in built.report.attention)


@pytest.mark.parametrize("name, dims", [("bert", SEQUENCE), ("gpt2-hf", SEQUENCE), ("llama-hf", SEQUENCE),
                                        ("llama-hf", BATCH_AND_SEQUENCE)],
                         ids=["bert-s", "gpt2-hf-s", "llama-hf-s", "llama-hf-b-s"])
def test_transformers_model_with_symbolic_sizes_builds_once_and_matches_eager(name, dims):
    # Called with input_ids only; one build serves every length.
    mod, inputs, _ = import_model(name, "test", dynamic_shapes=(dims,))
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    assert cpu.report.plans and not cpu.report.fallbacks, cpu.report.details()
    model, _ = make_model(name, "test")
    batches = (2, 2, 2) if 0 not in dims else (1, 3, 2)
    for batch, length in zip(batches, (2, 16, 77)):
        ids = torch.randint(0, 500, (batch, length))
        (out,) = run_cpu(cpu.executable, [ids.numpy()])
        np.testing.assert_allclose(out, eager_outputs(model, (ids,))[0], rtol=1e-3, atol=1e-4)
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert not [g for g in cuda.report.fallbacks if "symbolic" in g.fallback or "well-formed" in g.fallback]
    # the fused attention, over a key length of at most 128, is planned for that bound
    assert all(128 in dict(r.plan.shape.priced_at).values() for r in cuda.report.attention)
    # as many launches per call as the static build (whose masks and rotary tables are constants): every
    # attention fused, its mask (computed from the length) found causal or empty at every length within
    # the bounds, the rotary tables read from their values at the upper bound
    static_mod, _, _ = import_model(name, "test")
    static = build(static_mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert _fused_attentions(cuda) == _fused_attentions(static) == len(cuda.report.attention) > 0
    assert [r.plan.shape.mask for r in cuda.report.attention] == [r.plan.shape.mask for r in static.report.attention]
    assert count_launches(cuda.lowered, cuda.executable) == count_launches(static.lowered, static.executable)


def test_symbolic_llama_kernels_run_with_simt_semantics_at_their_bounds():
    """Symbolic batch and sequence: every stitched CUDA kernel (the embedding's RMSNorm, RMSNorm over b x s
    rows) and the fused attention (its causal mask, computed in the graph from the length, proved causal
    and computed from the indices; Q and K read through the head split and the rotary embedding) built
    once and run at each size's lower bound, an odd value and its upper bound (the attention at the first
    two: its pocl run at the upper bound alone takes half a minute)."""
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    from attention_reference import reference_func
    from tvm_stitch.simt.opencl_run import NoOpenclDevice, device_for
    from tvm_stitch.simt.simt_kernel import Reference, check_kernel
    from tvm_stitch.simt.symbolic_sizes import recorded_bounds, size_points
    from tvm_stitch.rewrites.attention import kernel_for

    try:
        device = device_for(False)
    except NoOpenclDevice as err:
        pytest.skip(str(err))
    mod, _, _ = import_model("llama-hf", "test", dynamic_shapes=(BATCH_AND_SEQUENCE,))
    report = simt.check(mod)
    assert len(report.kernels) >= 2, str(report)
    assert all(len(k.sizes) == 3 for k in report.kernels), str(report)
    assert report.ok, str(report)
    plan = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True).report.attention[0].plan
    assert plan.shape.mask == "causal"
    kernel, ref = kernel_for(plan), reference_func(plan.shape)
    attention = check_kernel("fused_attention", kernel, [Reference(ref, tuple(range(len(ref.params))))], device,
                             False, 0, points=size_points(kernel, *recorded_bounds(mod), {})[:2])
    assert attention.ok and len(attention.sizes) == 2, attention.detail


@pytest.mark.parametrize("name, size", [("gpt2", "test"), ("llama", "test"), ("convnext", "test")])
def test_model_forward_is_correct_with_fewer_memory_intensive_launches(name, size):
    mod, inputs, expected = import_model(name, size)
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    (out,) = run_cpu(cpu.executable, inputs)
    np.testing.assert_allclose(out, expected[0], rtol=1e-3, atol=1e-3)
    counts, built = _cuda_counts(mod)
    assert counts[True][0] < counts[False][0]
    # matmuls keep TVM's default handling, but for a fused attention: one launch for its two batched matmuls
    assert counts[True][1] == counts[False][1] - _fused_attentions(built)


def test_unknown_models_and_sizes_are_refused():
    from tvm_stitch.tools.models import make_model

    with pytest.raises(KeyError, match="unknown model 'resnet'"):
        make_model("resnet")
    with pytest.raises(ValueError, match="size must be one of"):
        make_model("gpt2", "huge")


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformer_forward_sheds_70_percent_of_memory_launches_and_keeps_dlight_matmul(name):
    """GEMM boundaries: copies, splits and rotary embeddings fold into the matmuls (CUDA build counts),
    except where the time model prices a fold (or an epilogue) above the matmul and its producers
    (or the copy) apart (LLaMA's rotary gathers, pricing/fold_price.py and epilogue_price.py): each such
    refusal is noted and may keep a launch. A fused attention (rewrites/attention.py) is one compute launch
    where TVM's default launches its two batched matmuls; a chain that keeps TVM's path says that path is
    modeled faster (LLaMA's at bench size: Q and K through RoPE read element by element)."""
    from tvm_stitch.analysis.classify import is_compute_kernel
    from tvm_stitch.tools.launches import primfunc_calls

    mod, _, _ = import_model(name, "bench")
    counts, built = _cuda_counts(mod)
    refused = [note for note in built.report.notes if "stays a kernel" in note and ", modeled" in note]
    assert counts[True][0] <= 0.3 * counts[False][0] + len(refused)
    kept = [r.reason.code for r in built.report.attention if not r.fused]
    assert built.report.attention and set(kept) <= {"attention-default-faster"}, kept
    assert counts[True][1] == counts[False][1] - _fused_attentions(built)
    for func_name in primfunc_calls(built.lowered):
        func = built.lowered[func_name]
        if "tvm_stitch.schedule_rule" in func.attrs and is_compute_kernel(func):
            assert str(func.attrs["tvm_stitch.schedule_rule"]) == "Matmul", func_name


def test_bert_with_symbolic_sequence_has_no_fallback_for_a_shape_form():
    # The head merge hands `s * 2` rows to a reshape declaring `2 * s`: FuseTIR compares the forms
    # literally, so the outlined group takes each parameter in its member's form.
    mod, _, _ = import_model("bert", "test", dynamic_shapes=(SEQUENCE,))
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    reasons = [g.fallback for g in cuda.report.fallbacks]
    assert not [r for r in reasons if "Parameter expression" in r or "symbolic" in r or "well-formed" in r], reasons


def test_symbolic_sequence_fuses_the_same_matmul_epilogues_as_the_static_build():
    # Under a symbolic sequence AnnotateTIROpPattern labels the reshapes after the matmuls opaque;
    # relabelled like their static forms, the FFN's GELU and the residual adds join the matmuls'
    # kernels (scheduled by dlight's Matmul), not stitched groups of their own.
    from tvm_stitch.analysis.classify import is_compute_kernel
    from tvm_stitch.tools.launches import primfunc_calls

    counts, attentions = {}, {}
    for dims in (None, (SEQUENCE,)):
        mod, _, _ = import_model("bert", "test", dynamic_shapes=dims)
        built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
        counts[dims is None] = launches_by_kind(built.lowered, built.executable)
        attentions[dims is None] = _fused_attentions(built)
    # the attentions fused as in the static build (symbolic lengths, the mask found empty at every length)
    assert attentions[True] == attentions[False] > 0
    assert counts[False] == counts[True]
    assert not [g for g in built.report.groups if "gelu" in g.ops]
    calls = primfunc_calls(built.lowered)
    assert sum(n for name, n in calls.items() if name.startswith("fused_matmul") and name.endswith("_gelu")) == 2
    assert sum(n for name, n in calls.items() if name.startswith("fused_matmul") and "epilogue_add" in name) == 4
    for name in calls:
        if name.startswith("fused_matmul") and is_compute_kernel(built.lowered[name]):
            assert str(built.lowered[name].attrs["tvm_stitch.schedule_rule"]) == "Matmul", name


def test_gpt2_final_layer_norm_stitches_under_a_symbolic_sequence():
    # The reshape after the last LayerNorm indexes (b * s + t) // s % 2: rewritten in the proven
    # form (unrewritten it does not lower), the LayerNorm's row stays on chip at a static size.
    mod, _, _ = import_model("gpt2-hf", "test", dynamic_shapes=(SEQUENCE,))
    built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    final = [g for g in built.report.groups if g.ops and g.ops[-1].startswith("reshape") and "layer_norm" in g.ops]
    assert final and all(g.stitched for g in final), [g.fallback for g in final]
    assert not [g for g in built.report.fallbacks if "stack allocation" in g.fallback]


def test_transformers_decoder_masks_fold_on_the_host_and_cuda_launches_fall_70_percent():
    """llama-hf with input_ids alone: the packed-sequence check and causal mask (a cumsum scan on TVM's
    CUDA path) are constants evaluated at compile time; the folded module still matches eager."""
    from tvm_stitch.rewrites.host_constants import FoldHostConstants
    from tvm_stitch.target import default_pipeline

    mod, inputs, expected = import_model("llama-hf", "test")
    target = tvm.target.Target("llvm")
    folded = FoldHostConstants()(mod)
    assert "cumsum" not in folded["main"].script()
    (out,) = run_cpu(tvm.compile(folded, target=target, relax_pipeline=default_pipeline(target)), inputs)
    np.testing.assert_allclose(out, expected[0], rtol=1e-4, atol=1e-5)
    counts, built = _cuda_counts(mod)
    assert counts[True][0] <= 0.3 * counts[False][0]
    assert counts[True][1] == counts[False][1] - _fused_attentions(built)
