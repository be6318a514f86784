"""Training graphs of the real models: backward and Adam, against PyTorch (skipped without the torch extra)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_stitch.tools.build import build, run_cpu  # noqa: E402
from tvm_stitch.tools.launches import launches_by_kind  # noqa: E402
from tvm_stitch.tools.model_bench import relative_error  # noqa: E402
from tvm_stitch.tools.training import (  # noqa: E402
    LayerNormTrapError,
    check_layer_norm_stats,
    decompositions,
    import_adam,
    import_backward,
)


def _memory_launches(mod):
    counts = {}
    for stitched in (False, True):
        built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=stitched)
        counts[stitched] = launches_by_kind(built.lowered, built.executable)
    return counts


def test_gpt2_backward_matches_pytorch_gradients_with_fewer_launches():
    mod, inputs, expected = import_backward("gpt2", "test")
    # inputs: x, cotangent, then the parameters; outputs: y, then one gradient per parameter
    assert len(expected) == len(inputs) - 1
    outs = run_cpu(build(mod, {"kind": "llvm"}, stitched=True).executable, inputs)
    assert len(outs) == len(expected)
    for out, ref in zip(outs, expected):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max() + 1e-6)
    assert relative_error(outs, expected) < 1e-4
    counts = _memory_launches(mod)
    assert counts[True][0] < counts[False][0] // 2
    assert counts[True][1] <= counts[False][1]


def test_llama_adam_step_matches_torch_optim_adam():
    mod, inputs, expected = import_adam("llama", "test")
    assert len(inputs) == 4 * (len(expected) // 3)
    outs = run_cpu(build(mod, {"kind": "llvm"}, stitched=True).executable, inputs)
    for out, ref in zip(outs, expected):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7)
    counts = _memory_launches(mod)
    assert counts[False][1] == counts[True][1] == 0
    assert counts[True][0] < counts[False][0] // 2


@pytest.mark.slow
@pytest.mark.parametrize("name, embeddings", [("gpt2-hf", ("wte.weight", "wpe.weight")),
                                              ("llama-hf", ("embed_tokens.weight",)),
                                              ("bert", ("bert.embeddings.word_embeddings.weight",))])
def test_transformers_backward_trains_the_embeddings_and_matches_pytorch_gradients(name, embeddings):
    from tvm_stitch.tools.models import make_model

    model, _ = make_model(name, "test")
    names = [n for n, _ in model.named_parameters()]
    mod, inputs, expected = import_backward(name, "test")
    # inputs: ids, cotangent, then the trained parameters (the embeddings among them)
    for embedding in embeddings:
        assert embedding in names
    assert len(expected) == len(inputs) - 1 >= len(names) - 2  # BERT's pooler gets no gradient
    outs = run_cpu(build(mod, {"kind": "llvm"}, stitched=True).executable, inputs)
    assert relative_error(outs, expected) < 1e-4
    table = expected[1 + names.index(embeddings[0])]  # the word embeddings' gradient: rows of repeated ids
    np.testing.assert_allclose(outs[1 + names.index(embeddings[0])], table, rtol=1e-3,
                               atol=1e-4 * np.abs(table).max())


def _layer_norm_vjp_graph(table):
    from torch.fx.experimental.proxy_tensor import make_fx

    norm = torch.nn.LayerNorm(8)
    names = [n for n, _ in norm.named_parameters()]

    def joint(x, cot, *weights):
        out, vjp = torch.func.vjp(lambda ws: torch.func.functional_call(norm, dict(zip(names, ws)), (x,)), weights)
        return (out, *vjp(cot)[0])

    args = (torch.randn(4, 8), torch.randn(4, 8), *(p.detach() for p in norm.parameters()))
    return make_fx(joint, decomposition_table=table)(*args)


def test_native_layer_norm_stats_trap_is_refused_and_avoided():
    from torch._decomp import core_aten_decompositions

    trapped = _layer_norm_vjp_graph(core_aten_decompositions())
    with pytest.raises(LayerNormTrapError, match="native_layer_norm"):
        check_layer_norm_stats(trapped.graph)
    check_layer_norm_stats(_layer_norm_vjp_graph(decompositions()).graph)


def test_relative_error_measures_near_zero_gradients_against_the_overall_scale():
    expected = [np.array([10.0, -4.0]), np.array([1e-9, -1e-9])]
    outs = [np.array([10.001, -4.0]), np.array([3e-7, 0.0])]
    assert relative_error(outs, expected) == pytest.approx(1e-4)
