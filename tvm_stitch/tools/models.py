"""Real model graphs: PyTorch models imported into Relax through torch.export.

Needs the optional extra (`pip install torch==2.13.0 transformers`); nothing
is downloaded from a hub: weights are random, from configs.

- bert: transformers' BertModel (base sizes, 2 layers), batch 8 x sequence 128;
- gpt2: a GPT-2 block stack written in PyTorch (pre-LayerNorm, causal
  attention, GELU MLP, final LayerNorm);
- llama: a LLaMA-style block stack in PyTorch (RMSNorm, rotary embedding,
  SwiGLU);
- gpt2-hf, llama-hf: transformers' GPT2Model (its default attention) and
  LlamaModel, called with `input_ids` alone, as users bring them
  (frontend.from_torch handles the importer's traps: the KV cache, bool
  cumsum, sdpa);
- convnext: ConvNeXt-style vision blocks in PyTorch (4x4 patch stem,
  depthwise 7x7 conv, LayerNorm over channels in NHWC, GELU MLP, layer scale).
Each is imported through `tvm_stitch.frontend.from_torch`, the weights as constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ModelCase:
    name: str
    description: str
    make: Callable  # (size) -> (torch module, example inputs tuple); a size of SIZES
    no_backward: str = ""  # why the model has no backward graph ("" when it has one)


SIZES = ("bench", "cpu", "test")  # "cpu": the CPU model bench's sizes (hidden 384, batch 4 x 128)


def _require_torch():
    try:
        import torch
    except ImportError as err:
        raise RuntimeError("real models need the torch extra: pip install torch==2.13.0 transformers") from err
    return torch


def _bert(size):
    torch = _require_torch()
    from transformers import BertConfig, BertModel

    d, heads, batch, seq = {"bench": (768, 12, 8, 128), "cpu": (384, 6, 4, 128), "test": (64, 4, 2, 16)}[size]
    cfg = BertConfig(num_hidden_layers=2, hidden_size=d, num_attention_heads=heads,
                     intermediate_size=4 * d, vocab_size=512 if size == "test" else 30522,
                     attn_implementation="eager")
    bert = BertModel(cfg).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    return Encoder().eval(), (torch.randint(0, cfg.vocab_size, (batch, seq)),)


def _gpt2_hf(size):
    torch = _require_torch()
    from transformers import GPT2Config, GPT2Model

    d, heads, vocab, batch, seq = {"bench": (768, 12, 50257, 4, 128), "cpu": (384, 6, 50257, 4, 128),
                                   "test": (64, 4, 1000, 2, 16)}[size]
    cfg = GPT2Config(n_layer=2, n_embd=d, n_head=heads, vocab_size=vocab,
                     n_positions=128 if size == "test" else 1024, bos_token_id=0, eos_token_id=0)
    return GPT2Model(cfg).eval(), (torch.randint(0, vocab, (batch, seq)),)


def _llama_hf(size):
    torch = _require_torch()
    from transformers import LlamaConfig, LlamaModel

    d, hidden, heads, vocab, batch, seq = {"bench": (512, 1376, 8, 32000, 4, 128), "cpu": (384, 1024, 6, 32000, 4, 128),
                                           "test": (64, 160, 4, 1000, 2, 16)}[size]
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=d, intermediate_size=hidden, vocab_size=vocab,
                      num_attention_heads=heads, num_key_value_heads=heads // 2,
                      max_position_embeddings=128 if size == "test" else 2048)
    return LlamaModel(cfg).eval(), (torch.randint(0, vocab, (batch, seq)),)


def _block_stack(nn, make_block, layers: int, final_norm):
    """`layers` blocks applied in turn, then `final_norm`: the GPT-2 and LLaMA-style stacks."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([make_block() for _ in range(layers)])
            self.norm = final_norm

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    return Stack().eval()


def _gpt2(size):
    torch = _require_torch()
    nn = torch.nn
    d, heads, layers, batch, seq = {"bench": (768, 12, 2, 4, 128), "cpu": (384, 6, 2, 4, 128),
                                    "test": (64, 4, 1, 2, 16)}[size]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), -1e4), 1))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (a.view(b, t, heads, d // heads).transpose(1, 2) for a in (q, k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads) + self.mask[:t, :t], dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    return _block_stack(nn, Block, layers, nn.LayerNorm(d)), (torch.randn(batch, seq, d),)


def _llama(size):
    torch = _require_torch()
    nn = torch.nn
    d, heads, hidden, layers, batch, seq = {"bench": (512, 8, 1376, 2, 4, 128), "cpu": (384, 6, 1024, 2, 4, 128),
                                            "test": (64, 4, 160, 1, 2, 16)}[size]

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rotate(x, cos, sin):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
            self.down = nn.Linear(hidden, d, bias=False)
            freqs = 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads)))
            angles = torch.outer(torch.arange(seq).float(), freqs)
            self.register_buffer("cos", torch.cat((angles.cos(), angles.cos()), -1))
            self.register_buffer("sin", torch.cat((angles.sin(), angles.sin()), -1))
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), -1e4), 1))

        def forward(self, x):
            b, t, _ = x.shape
            h = self.n1(x)
            q, k, v = (p(h).view(b, t, heads, d // heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads) + self.mask, dim=-1)
            x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
            h = self.n2(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    return _block_stack(nn, Block, layers, RMSNorm()), (torch.randn(batch, seq, d),)


def _convnext(size):
    torch = _require_torch()
    nn = torch.nn
    dim, layers, batch, image = {"bench": (192, 2, 8, 224), "cpu": (96, 2, 2, 224), "test": (32, 1, 2, 32)}[size]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = nn.LayerNorm(dim)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.scale = nn.Parameter(torch.full((dim,), 0.5))

        def forward(self, x):
            h = self.dwconv(x).permute(0, 2, 3, 1)
            h = self.out(nn.functional.gelu(self.fc(self.norm(h))))
            return x + (self.scale * h).permute(0, 3, 1, 2)

    class ConvNeXt(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, dim, 4, stride=4)
            self.stem_norm = nn.LayerNorm(dim)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.norm = nn.LayerNorm(dim)

        def forward(self, x):
            x = self.stem_norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            for block in self.blocks:
                x = block(x)
            return self.norm(x.permute(0, 2, 3, 1))

    return ConvNeXt().eval(), (torch.randn(batch, 3, image, image),)


MODELS = {
    case.name: case
    for case in [
        ModelCase("bert", "transformers BertModel, 2 layers, hidden 768, batch 8 x 128", _bert),
        ModelCase("gpt2", "GPT-2 block stack (PyTorch), 2 layers, hidden 768, batch 4 x 128", _gpt2),
        ModelCase("llama", "LLaMA-style blocks (PyTorch): RMSNorm, rotary, SwiGLU; 2 layers, 4 x 128", _llama),
        ModelCase("gpt2-hf", "transformers GPT2Model (default attention), 2 layers, hidden 768, batch 4 x 128",
                  _gpt2_hf),
        ModelCase("llama-hf", "transformers LlamaModel, 2 layers, hidden 512, batch 4 x 128", _llama_hf),
        ModelCase("convnext", "ConvNeXt-style blocks (PyTorch): depthwise 7x7 conv, LayerNorm over channels, GELU; "
                  "2 blocks, 192 channels, 8 x 3 x 224 x 224", _convnext,
                  no_backward="its training graph (convolution_backward, which from_torch "
                  "converts) is not checked against PyTorch yet"),
    ]
}


DTYPES = ("float32", "float16", "bfloat16")


def make_model(name: str, size: str = "bench", dtype: str = "float32"):
    """(torch module in eval mode, example inputs) of a model, seeded; cast to `dtype` (its floating
    inputs too) as a user casts it, with `.to(torch.float16)` or `.to(torch.bfloat16)`."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, not {size!r}")
    torch = _require_torch()
    torch.manual_seed(0)
    model, inputs = MODELS[name].make(size)
    return model.to(torch_dtype(dtype)), cast_floats(inputs, dtype)


def torch_dtype(dtype: str):
    """The torch dtype of one of DTYPES."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    return getattr(_require_torch(), dtype)


def cast_floats(tensors, dtype: str) -> tuple:
    """The floating tensors of `tensors` cast to `dtype`, the others (token ids) as they are."""
    target = torch_dtype(dtype)
    return tuple(t.to(target) if t.is_floating_point() else t for t in tensors)


def as_numpy(tensor):
    """A torch tensor as numpy; bfloat16 as ml_dtypes' bfloat16 (numpy has none), which TVM reads."""
    torch = _require_torch()
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def import_model(name: str, size: str = "bench", dynamic_shapes=None, dtype: str = "float32"):
    """(Relax module, numpy inputs, PyTorch float32 eager outputs as numpy) of a model's forward.

    `dynamic_shapes`: torch.export's, for the model's positional inputs (a tuple).
    `dtype`: the model is cast to it and imported so; the expected outputs are
    always float32 eager's, of the same (cast) weights and inputs in float32.
    """
    import warnings

    from tvm_stitch.frontend import from_torch

    model, inputs = make_model(name, size, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # from_torch's notes on the export settings of transformers models
        mod = from_torch(model, inputs, dynamic_shapes=dynamic_shapes)
    return mod, [as_numpy(a) for a in inputs], eager_outputs(model.float(), cast_floats(inputs, "float32"))


def eager_outputs(model, inputs) -> list:
    """PyTorch eager outputs of `model(*inputs)` as numpy: its tensors (a transformers output's too)."""
    torch = _require_torch()
    with torch.no_grad():
        expected = model(*inputs)
    if hasattr(expected, "to_tuple"):
        expected = expected.to_tuple()
    outputs = expected if isinstance(expected, tuple) else (expected,)
    return [as_numpy(o) for o in outputs if isinstance(o, torch.Tensor)]
