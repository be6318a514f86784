"""torch's scaled_dot_product_attention, imported as TVM's attention op (R.nn.attention, attention_bias),
fused as one kernel: causal flag, float mask, a symbolic length; the reason where it cannot be."""

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from tvm_stitch.analysis.attention_chain import find_chains
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.workloads.relax_blocks import function, tensor

torch = pytest.importorskip("torch")


class _Sdpa(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)


@pytest.mark.parametrize("causal, masked, symbolic", [pytest.param(True, False, True, marks=pytest.mark.slow),
                                                      (False, True, False)], ids=["causal-symbolic", "float-mask"])
def test_torch_sdpa_is_one_kernel_matching_torch(causal, masked, symbolic):
    from tvm_stitch.frontend import from_torch

    def inputs(n):
        args = tuple(torch.randn(1, 2, n, 16) for _ in range(3))
        return args + ((torch.where(torch.rand(1, 1, n, n) < 0.2, -1.0e4, 0.0),) if masked else ())

    dims = None
    if symbolic:
        s = torch.export.Dim("s", min=2, max=64)
        dims = ({2: s}, {2: s}, {2: s})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = from_torch(_Sdpa(causal), inputs(24), dynamic_shapes=dims)
    built = build(mod, host_target(), stitched=True)
    assert [r.plan.shape.mask for r in built.report.attention] == ["causal" if causal else "additive"]
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    for n in (24, 45) if symbolic else (24,):
        args = inputs(n)
        got = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])[0].numpy()
        np.testing.assert_allclose(got, _Sdpa(causal)(*args).numpy(), rtol=1e-4, atol=1e-5)


def test_top_left_causal_attention_over_other_lengths_falls_back_with_reason():
    """R.nn.attention's TopLeft causal mask over 8 queries and 12 keys: the kernel aligns the diagonal at
    the end, so the chain keeps TVM's path."""
    q, k = tensor("q", (1, 2, 8, 16), "float32"), tensor("k", (1, 2, 12, 16), "float32")

    def body(bb, q, k):
        q2, k2 = (bb.emit(op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k))
        out = bb.emit(op.nn.attention(q2, k2, k2, causal_mask="TopLeft"))
        return bb.emit(op.permute_dims(out, [0, 2, 1, 3]))

    chains, others = find_chains(function([q, k], body)["main"])
    assert not chains and [o.code for o in others] == ["attention-causal-alignment"]
