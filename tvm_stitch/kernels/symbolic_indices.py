"""A fused PrimFunc's indices over symbolic sizes rewritten in the simple form the analysis proves.

A reshape over a symbolic sequence length indexes its input per element as
`(i * s + j) // s % 2` and `(i * s + j) % s`: TVM's simplifier keeps those
for a symbolic `s` even where `0 <= j < s` is known. The analysis reads them
as `i` and `j` (tir_view), so the planner keeps a row on chip, but the
schedule's buffer regions are derived from the written forms: a row cache
(or a reduction result) read through them is not narrowed to the block's
row, its allocation keeps a symbolic size, and the lowering rejects it
("Can only handle constant size stack allocation"). Rewriting every block's
indices (body and read/write regions) into the proven forms, with each
block's iterators bound to their domains, makes the schedule see what the
analysis saw.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, sym, tirx

from tvm_stitch.analysis.tir_view import divides_by_symbolic, proven_index


def _simplified_block(block: s_tir.SBlock) -> s_tir.SBlock:
    if not block.iter_vars:
        return block
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)

    def on_index(node):
        return proven_index(node, analyzer)

    return tvm_ffi.structural_map(block, ((tirx.FloorDiv, tirx.FloorMod), on_index), order="pre")


def simplify_symbolic_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with the divisions and remainders by symbolic sizes in its blocks resolved where proven."""
    if not divides_by_symbolic(func):
        return func
    return tvm_ffi.structural_map(func, (s_tir.SBlock, _simplified_block), order="pre")
