"""torch.compile(model, backend="tvm_stitch"): transformers models forward and in training, against eager."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_stitch.torch as ts  # noqa: E402
from tvm_stitch.torch import EagerFallbackWarning  # noqa: E402

VOCAB = 256


def _bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                vocab_size=VOCAB, max_position_embeddings=64))


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                bos_token_id=0, eos_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def _convnext():
    from transformers import ConvNextConfig, ConvNextModel

    return ConvNextModel(ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32))


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "convnext": _convnext}


def _make(name, train=False):
    torch.manual_seed(0)
    model = MODELS[name]()
    for module in model.modules():  # dropout off, so eager and compiled see one function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model.train(train)


def _input(name, length=9):
    if name == "convnext":
        return torch.randn(2, 3, 32, 32)
    return torch.randint(0, VOCAB, (2, length))


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformers_forward_matches_eager_and_three_lengths_build_once(name):
    model = _make(name)
    backend = ts.backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (5, 11, 17):
            ids = _input(name, length)
            got, want = compiled(ids).last_hidden_state, model(ids).last_hidden_state
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert backend.counters.compiles == 1, backend.counters
    assert backend.counters.eager_fallbacks == 0, backend.counters


def test_convnext_forward_matches_eager():
    model = _make("convnext")
    backend = ts.backend()
    compiled = torch.compile(model, backend=backend)
    images = _input("convnext")
    with torch.no_grad():
        torch.testing.assert_close(compiled(images).last_hidden_state, model(images).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)
    assert backend.counters.compiles == 1 and backend.counters.eager_fallbacks == 0, backend.counters


def _train(model, forward, step, optimizer, inputs) -> list:
    losses = []
    for _ in range(3):
        loss = forward(inputs).last_hidden_state.pow(2).mean()
        loss.backward()
        step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# AdamW's update is lr * m / (sqrt(v) + eps): with the default eps a gradient element near zero (a LayerNorm's
# input gradient sums to zero over its row) moves its weight by lr either way on a rounding difference;
# eps = 1e-3 keeps the update proportional to the gradient there, so the weights compare within float32 error.
ADAMW = {"lr": 1e-3, "eps": 1e-3, "foreach": True}


@pytest.mark.parametrize("name, compiled_step", [
    pytest.param("bert", False, marks=pytest.mark.slow), pytest.param("gpt2", False, marks=pytest.mark.slow),
    ("llama", True), pytest.param("convnext", False, marks=pytest.mark.slow)])
def test_three_adamw_steps_match_eager_losses_and_weights(name, compiled_step):
    torch._dynamo.reset()  # dynamo's caches from earlier tests would serve (or refuse) the step's graph
    model = _make(name, train=True)
    reference = copy.deepcopy(model)
    backend = ts.backend()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    step = torch.compile(optimizer.step, backend=backend) if compiled_step else optimizer.step
    inputs = _input(name)
    losses = _train(model, torch.compile(model, backend=backend), step, optimizer, inputs)
    expected = _train(reference, reference, expected_optimizer.step, expected_optimizer, inputs)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for (param_name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, p=param_name: f"{p}: {m}")
    assert backend.counters.compiles >= 2 + compiled_step, backend.counters  # forward, backward (, the step)
    assert backend.counters.eager_fallbacks == 0, backend.counters  # embedding and convolution gradients on TVM


def _scatter_adds(x, rows, columns, values, order):
    """x[rows, columns] += values: int32 rows against int64 columns broadcast (3, 1) x (4,), negative
    columns, repeated pairs, values broadcast along the rows; and a plain put of rows in another order."""
    added = torch.ops.aten.index_put(x, [rows, columns], values, True)
    return added, torch.ops.aten.index_put(x, [order], x[:4] * 2, False)


def test_index_put_with_broadcast_negative_and_repeated_indices_matches_eager():
    x = torch.randn(6, 5)
    rows = torch.tensor([[0], [2], [0]], dtype=torch.int32)
    columns = torch.tensor([-1, 1, 1, -5])
    values, order = torch.randn(4), torch.tensor([3, 0, -1, 1])
    got = torch.compile(_scatter_adds, backend=ts.backend(strict=True))(x, rows, columns, values, order)
    for g, w in zip(got, _scatter_adds(x, rows, columns, values, order)):
        torch.testing.assert_close(g, w)


def _new_gelu_and_powers(x):
    """GPT-2's GELU (transformers' NewGELUActivation: a float cube), an int square and a fractional power."""
    gelu = 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
    return (gelu + x.pow(2) - x.abs().pow(2.5),)


def test_a_small_whole_power_is_multiplications_not_a_libm_call():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tvm_stitch.torch.graph_import import import_graph

    x = torch.randn(4, 8)
    gm = make_fx(_new_gelu_and_powers)(x)
    assert sorted(n.args[1] for n in gm.graph.nodes if "pow" in str(n.target)) == [2, 2.5, 3.0]
    text = import_graph(gm, [x]).mod.script()
    assert text.count("R.power(") == 1, text  # the cube and the square are multiplications; 2.5 stays a power
    backend = ts.backend(strict=True)
    torch.testing.assert_close(torch.compile(_new_gelu_and_powers, backend=backend)(x), _new_gelu_and_powers(x))


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(50, 16), torch.nn.Embedding(20, 16)

    def forward(self, ids):
        return (self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))).tanh()


class _Convolutions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.depthwise = torch.nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.grouped = torch.nn.Conv2d(8, 12, 3, stride=2, padding=1, dilation=2, groups=2)
        self.unbiased = torch.nn.Conv2d(12, 6, 3, stride=3, bias=False)

    def forward(self, x):
        return self.unbiased(self.grouped(self.depthwise(self.patch(x)).relu()).tanh())


@pytest.mark.parametrize("make, x", [
    (_Embedded, torch.tensor([[1, 3, 3, 7, 1, 1], [3, 49, 0, 1, 7, 3]])),  # repeated ids accumulate
    (_Convolutions, torch.randn(2, 3, 37, 41)),  # sizes the strides do not divide: output padding, crops
], ids=["embedding", "convolution"])
def test_embedding_and_convolution_gradients_are_built_on_tvm_and_match_eager(make, x):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = x.requires_grad_() if x.is_floating_point() else x
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    backend = ts.backend(strict=True)  # an op left to eager would raise
    torch.compile(model, backend=backend)(x).pow(2).mean().backward()
    reference(x_ref).pow(2).mean().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if x.requires_grad:
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert (backend.counters.compiles, backend.counters.eager_fallbacks) == (2, 0), backend.counters


class _Erfinv(torch.nn.Module):
    def forward(self, x):
        return torch.special.erfinv(torch.tanh(x) * 0.5)  # no converter for erfinv in TVM 0.27's importer


class _Clipped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.act = _Erfinv()
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.act(self.proj(x))).softmax(-1)


def test_an_op_without_converter_runs_on_eager_with_one_warning_and_the_rest_on_tvm():
    model = _Clipped()
    backend = ts.backend()
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = torch.compile(model, backend=backend)(x)
    fallbacks = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert "erfinv.default in act (_Erfinv)" in str(fallbacks[0].message)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)
    assert backend.counters.eager_fallbacks == 1 and backend.counters.compiles == 2, backend.counters


def test_strict_raises_where_the_default_runs_on_eager():
    with torch.no_grad(), pytest.raises(Exception, match="erfinv"):
        torch.compile(_Clipped(), backend=ts.backend(strict=True))(torch.randn(3, 8))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))


def test_the_cache_serves_a_second_model_of_one_architecture_from_memory_and_disk(tmp_path):
    x = torch.randn(4, 8)
    first = ts.backend(cache=str(tmp_path))
    with torch.no_grad():
        torch.compile(_mlp(), backend=first)(x)
        torch._dynamo.reset()  # else dynamo reuses its own build of Sequential.forward, never asking the backend
        torch.compile(_mlp(), backend=first)(x)
    assert (first.counters.compiles, first.counters.cache_hits) == (1, 1), first.counters
    assert len(list(tmp_path.glob("*/lib.so"))) == 1
    torch._dynamo.reset()
    second = ts.backend(cache=str(tmp_path))
    model = _mlp()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=second)(x), model(x))
    assert (second.counters.compiles, second.counters.disk_hits) == (0, 1), second.counters
    uncached = ts.backend(cache=False)
    with torch.no_grad():
        torch.compile(_mlp(), backend=uncached)(x)
        torch._dynamo.reset()
        torch.compile(_mlp(), backend=uncached)(x)
    assert (uncached.counters.compiles, uncached.counters.cache_hits) == (2, 0), uncached.counters


def test_bad_options_are_refused_when_the_backend_is_made():
    with pytest.raises(TypeError, match="strict"):
        ts.backend(strict="yes")
    with pytest.raises(ValueError, match="supports target kinds"):
        ts.backend(target="opencl")
    with pytest.raises(TypeError, match="unexpected keyword"):
        ts.backend(fusoin=False)
    with pytest.raises(TypeError, match="fusion must be one of 'greedy', 'search' or False"):
        ts.backend(fusion=True)
    assert ts.backend().options.fusion == "search"  # the default: the fusion search
    assert ts.backend(fusion="greedy").options.fusion == "greedy"


def test_the_entry_point_registers_the_backend_for_a_plain_name():
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("tvm-stitch")
    except PackageNotFoundError:
        pytest.skip("tvm-stitch is not installed with metadata (pip install -e .)")
    points = [e for e in dist.entry_points if e.group == "torch_dynamo_backends"]
    assert [(e.name, e.value) for e in points] == [("tvm_stitch", "tvm_stitch.torch:compile_graph")], \
        "the installed metadata has no torch_dynamo_backends entry point: reinstall (pip install -e .)"
    from torch._dynamo import lookup_backend

    torch._dynamo.reset()

    assert lookup_backend("tvm_stitch") is ts.compile_graph
    before = ts.counters().compiles + ts.counters().cache_hits
    model = _mlp()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="tvm_stitch")(x), model(x))
    assert ts.counters().compiles + ts.counters().cache_hits == before + 1


def test_the_benchmark_command_refuses_unknown_models_and_steps(capsys):
    from tvm_stitch.tools.cli import main

    assert main(["torch-compile", "--models", "resnet"]) == 2
    assert main(["torch-compile", "--steps", "infer"]) == 2
    assert "unknown: infer" in capsys.readouterr().err
