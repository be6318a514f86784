"""frontend.from_torch: PyTorch modules through torch.export and TVM's importer, traps handled."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm  # noqa: E402
import tvm_stitch  # noqa: E402
from tvm_stitch.frontend import UnsupportedModelError, from_torch  # noqa: E402
from tvm_stitch.target import default_pipeline  # noqa: E402
from tvm_stitch.tools.build import build, run_cpu  # noqa: E402

from conftest import LLVM  # noqa: E402


def _run(mod, inputs):
    return run_cpu(build(mod, LLVM, stitched=True).executable, [a.numpy() for a in inputs])


def test_bool_cumsum_is_summed_as_int64():
    class Packed(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x > 0, dim=-1)

    x = torch.randn(3, 17)
    (got,) = _run(from_torch(Packed(), (x,)), [x])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, Packed()(x).numpy())


def test_symbolic_slices_keep_plain_shapes_and_match_at_several_lengths():
    class Positions(torch.nn.Module):
        """BERT's position slice of a long buffer, and the diff of transformers' packed-sequence check."""

        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(1, 512, 8))

        def forward(self, x):
            s = x.shape[1]
            steps = torch.diff(x[..., 0], dim=-1, prepend=x[:, :1, 0] - 1)
            return x + self.table[:, :s], torch.cumsum(steps != 1, dim=-1)

    model = Positions()
    mod = from_torch(model, (torch.randn(2, 16, 8),), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=512)},))
    assert "T.min" not in str(mod["main"].ret_ty)  # the importer's min(s, 512) cast to PyTorch's s
    built = build(mod, LLVM, stitched=True)
    for length in (2, 33, 300):
        x = torch.randn(2, length, 8)
        got = run_cpu(built.executable, [x.numpy()])
        for g, want in zip(got, model(x)):
            np.testing.assert_allclose(g, want.numpy(), rtol=1e-5, atol=1e-6)


def test_a_constant_slice_of_a_symbolic_axis_is_in_bounds_and_joins_its_reader():
    # transformers' packed-sequence check takes positions[:, 0:1]: in bounds (s >= 2), it keeps
    # PyTorch's extent 1 without a match_cast, which would cut the slice from the subtraction.
    from tvm_stitch.tools.launches import count_launches

    class FromFirst(torch.nn.Module):
        def forward(self, x):
            return x - x[:, 0:1] + x[:, 1:2]

    mod = from_torch(FromFirst(), (torch.randn(2, 16),), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=64)},))
    assert "match_cast" not in mod["main"].script()
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert count_launches(cuda.lowered, cuda.executable) == 1
    for length in (2, 9):
        x = torch.randn(2, length)
        (got,) = _run(mod, [x])
        np.testing.assert_allclose(got, FromFirst()(x).numpy(), rtol=1e-6)


def test_transformers_decoder_exports_without_cache_and_with_eager_attention_then_restores():
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                 bos_token_id=0, eos_token_id=0)).eval()
    attention = model.config._attn_implementation
    ids = torch.randint(0, 100, (1, 8))
    with pytest.warns(UserWarning, match="use_cache=False") as caught:
        mod = from_torch(model, (ids,))
    assert any("eager attention" in str(w.message) for w in caught)
    assert model.config.use_cache and model.config._attn_implementation == attention
    (got,) = _run(mod, [ids])
    with torch.no_grad():
        np.testing.assert_allclose(got, model(ids).last_hidden_state.numpy(), rtol=1e-4, atol=1e-5)


def test_layer_norm_statistics_are_refused_with_the_module_path():
    class Stats(torch.nn.Module):
        def forward(self, x):
            out, mean, _ = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
            return out + mean

    with pytest.raises(UnsupportedModelError, match="mean of native_layer_norm"):
        from_torch(Stats(), (torch.randn(4, 8),))


def test_unsupported_op_names_the_op_and_where():
    class Inner(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.det(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(UnsupportedModelError, match=r"in inner \(Inner\)"):
        from_torch(Outer(), (torch.randn(2, 3, 3),))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        from_torch(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="args must be a tuple"):
        from_torch(torch.nn.ReLU(), [torch.randn(2)])


def test_control_flow_module_builds_where_a_pipeline_pass_fails_and_explain_reports():
    class Branches(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: torch.softmax(x, -1).exp(), lambda x: torch.tanh(x) * 2, (x,))

    x = torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = from_torch(Branches(), (x,))
    import tvm

    tvm.compile(mod, target=LLVM, relax_pipeline=default_pipeline(LLVM))  # TVM's own pipeline builds it
    built = build(mod, LLVM, stitched=True)  # TVM's FastMathTransform raises on its branch functions
    for sign in (1, -1):
        (got,) = run_cpu(built.executable, [sign * np.abs(x.numpy())])
        np.testing.assert_allclose(got, Branches()(sign * x.abs()).numpy(), rtol=1e-5, atol=1e-6)
    report = tvm_stitch.explain(mod, LLVM)
    assert report.table().startswith("plans made for")


def test_a_failing_added_pass_is_skipped_with_a_note():
    from tvm_stitch.pipeline import guarded

    @tvm.transform.module_pass(opt_level=0, name="Broken")
    def broken(mod, _ctx):
        raise RuntimeError("broken on purpose")

    report = tvm_stitch.StitchReport()
    mod = tvm.IRModule()
    assert guarded(broken, report)(mod).same_as(mod)
    assert report.notes == ["Broken skipped: RuntimeError: broken on purpose"]


def test_an_embedding_gradient_imports_and_accumulates_repeated_ids():
    """index_put accumulating over 2-d token ids (an embedding's gradient), which TVM's importer refuses:
    the torch.compile backend's converter, repeated ids summed as PyTorch sums them."""

    class EmbeddingGradient(torch.nn.Module):
        def forward(self, ids, grad):
            return torch.zeros(10, 4).index_put((ids,), grad, accumulate=True)

    ids = torch.tensor([[1, 3, 3, 9], [3, 0, 1, 1]])
    grad = torch.randn(2, 4, 4)
    mod = from_torch(EmbeddingGradient(), (ids, grad))
    assert "scatter_nd" in mod["main"].script()
    (got,) = _run(mod, [ids, grad])
    np.testing.assert_allclose(got, EmbeddingGradient()(ids, grad).numpy(), rtol=1e-6, atol=1e-6)
