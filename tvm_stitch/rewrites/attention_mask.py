"""The kind of an attention mask computed from symbolic sizes alone, proved from its closed form.

Under a symbolic sequence length a decoder's causal mask is not a constant:
transformers builds it from `arange(0, s)` (and the position ids) in the
graph. Its closed form (analysis/closed_form: one expression of the mask's
indices and the sizes, e.g. `select(j <= i, 0, min)`) is examined by the
arithmetic analyzer under the sizes' bounds and the indices' extents: an
element proved 0 everywhere makes no mask; proved 0 where key `j` is seen by
query `i` (`j <= i + kv_len - q_len`) and at most MASKED elsewhere, a causal
mask the kernel computes from the indices. This holds for every size, bounded
or not. Otherwise (no closed form, nothing proved) the mask stays one the
kernel reads.
"""

from __future__ import annotations

from tvm import relax, tirx

from tvm_stitch.analysis.attention_chain import MASKED
from tvm_stitch.analysis.closed_form import Facts
from tvm_stitch.analysis.shape_dims import dims, same
from tvm_stitch.rewrites.closed_forms import closed_forms


def symbolic_mask_kind(func: relax.Function, mask: relax.Var, q_len, kv_len) -> str:
    """"none", "causal" or "additive" for `mask` (a var of `func`) over scores of q_len x kv_len."""
    facts = Facts.of_function(func)
    form = closed_forms(func, facts).get(mask)
    if form is None or not form.axes:
        return "additive"
    zero, low = tirx.const(0.0, form.dtype), tirx.const(MASKED, form.dtype)
    with facts.over(form.axes, form.shape):
        if facts.proves(form.element == zero):
            return "none"
        if len(form.axes) < 2 or not same(dims(mask)[-2:], (q_len, kv_len)):
            return "additive"
        i, j = form.axes[-2], form.axes[-1]
        seen = j <= i + (kv_len - q_len)
        with facts.analyzer.constraint_scope(seen):
            below = facts.proves(form.element == zero)
        with facts.analyzer.constraint_scope(tirx.Not(seen)):
            above = facts.proves(form.element <= low)
    return "causal" if below and above else "additive"
