"""The decomposition table aot_autograd traces with gives the ATen graphs of PyTorch's public core table."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from functorch.compile import min_cut_rematerialization_partition  # noqa: E402
from torch._decomp import core_aten_decompositions  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from tvm_stitch.tools.torch_compile_bench import model_output, prepared_model  # noqa: E402
from tvm_stitch.torch.decompositions import attention_as_math, decompositions  # noqa: E402


class _Composites(torch.nn.Module):
    """Ops that reach aot_autograd as CompositeImplicitAutograd ops (matmul, layer_norm, einsum, dropout)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.weight = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        y = torch.matmul(self.norm(x), self.weight)
        z = torch.einsum("bij,jk->bik", y, self.weight).softmax(-1)
        return torch.nn.functional.dropout(z, 0.0) + torch.nn.functional.gelu(y, approximate="tanh")


def _aten_graphs(table, model, inputs) -> list:
    """The code of every ATen graph aot_autograd hands a compiler for a training step of `model`."""
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def backend(gm, example_inputs):
        attention_as_math(gm)
        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=table,
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    torch._dynamo.reset()
    model_output(torch.compile(model, backend=backend)(*inputs)).pow(2).mean().backward()
    return graphs


@pytest.mark.parametrize("name", ["composites", "llama-hf"])
def test_the_post_autograd_table_traces_the_graphs_of_the_core_table(name):
    def made():
        torch.manual_seed(0)
        if name == "composites":
            return _Composites(), (torch.randn(2, 4, 16, requires_grad=True),)
        return prepared_model(name, "test", train=True)

    ours = _aten_graphs(decompositions(), *made())
    public = _aten_graphs(dict(core_aten_decompositions()), *made())
    assert len(ours) == 2 and ours == public


def test_the_table_leaves_out_composite_implicit_ops_and_keeps_the_core_ones():
    table = decompositions()
    aten = torch.ops.aten
    assert aten.matmul.default not in table  # decomposed at the autograd key, before aot_autograd traces
    assert aten.native_layer_norm_backward.default in table and aten.gelu_backward.default in table
