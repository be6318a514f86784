"""The decompositions aot_autograd traces with: PyTorch's core ATen table, and attention as its math.

Core ATen decompositions turn composite ops (and most backward ops) into
the element-wise ops and reductions that stitch. Scaled-dot-product
attention is traced as PyTorch's math implementation (matmul, softmax,
matmul): on the CPU PyTorch would pick its flash kernel, whose backward
op TVM's importer has no converter for. Dynamo's graph calls it as a
torch function, which autograd sees before any decomposition table, so
the call is replaced in dynamo's graph (`attention_as_math`).
"""

from __future__ import annotations


def decompositions() -> dict:
    """PyTorch's core ATen decompositions for tracing after autograd. The public
    `core_aten_decompositions()` adds an entry for every CompositeImplicitAutograd op of every namespace
    (a scan of about 0.1-0.4 s per process, most of a warm start's own work); aot_autograd traces below
    the autograd key, where those ops have already decomposed, so the ATen graphs are the same (checked
    for the models' forward and training graphs: tests/test_decompositions.py)."""
    from torch._decomp import _core_aten_decompositions_post_autograd

    return _core_aten_decompositions_post_autograd()


def attention_as_math(gm) -> None:
    """Replace dynamo graph `gm`'s scaled-dot-product attention calls by the math implementation."""
    import torch

    targets = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = _attention_math
            changed = True
    if changed:
        gm.recompile()


def _attention_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """PyTorch's math attention; a bool mask (True: attend) made additive first, as scaled_dot_product_attention
    does before it calls the math kernel (which reads a bool mask otherwise)."""
    import torch

    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
