"""Which copies after a matmul or convolution join its kernel on the CPU.

On llvm, RelabelMatmulEpilogues (rewrites/matmul_epilogue.py) runs with this
policy: a reshape on a matmul's element-wise path whose every reader is an
element-wise op that reads no other tensor as large as the reshape's
output (a bias, a per-channel scale, a GELU) is relabelled. A Linear on
4-D activations (matmul, bias, reshape back to 4-D, GELU) then keeps the
bias and GELU in the matmul's kernel, on its output tile
(schedules/cpu/contraction.py), instead of a pass of their own over the
whole output. A reshape read by a residual add (a full-size second
input) keeps its label: the add stays with the normalisation stitched
after it, which reads that input anyway (moved into the matmul it split
LLaMA's RMSNorm kernel: 0.90x-0.94x). Transposes and broadcasts keep their
labels: on the CPU they stay with the stitched kernels that read them.
Reshapes of symbolic size keep theirs too. Relabelled, the reshape back to
(batch, s, channels) splits the matmul's rows by `floordiv`/`floormod` by
the symbolic s, and the region TVM 0.27 gives the epilogue under the
matmul's row tile (reverse_compute_at) is the box of the tile's first and
last rows only: where a tile of 8 rows crosses into the next sequence (s =
77), rows of the tile are never written and others are read before the
matmul computed them (wrong values, NaN in BERT;
tests/test_cpu_convnext.py). On CUDA dlight's Matmul writes such an
epilogue element by element from its reindexed tile, which is exact.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.op_patterns import BROADCAST
from tvm_stitch.rewrites.matmul_epilogue import copy_kind

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _elements(expr) -> int | None:
    """Static element count of a tensor expression; None when symbolic or not a tensor."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    count = 1
    for dim in ty.shape.values:
        if not isinstance(dim, tirx.IntImm):
            return None
        count *= int(dim.value)
    return count


def _readers(mod: tvm.IRModule, var: relax.Var) -> list:
    """The calls of the module's Relax functions that take `var` as an argument (call_tir: in its tuple)."""
    found = []
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for binding in (b for block in func.body.blocks for b in block.bindings):
            call = binding.value
            if not isinstance(call, relax.Call):
                continue
            args = list(call.args[1].fields) if call.op.same_as(_CALL_TIR) else list(call.args)
            if any(a.same_as(var) for a in args if isinstance(a, relax.Expr)):
                found.append(call)
    return found


def _light_element_wise(mod: tvm.IRModule, call: relax.Call, var: relax.Var) -> bool:
    """`call` is element-wise (or broadcast) and its other tensor inputs are smaller than `var`."""
    if not call.op.same_as(_CALL_TIR):
        return False
    callee = mod[call.args[0]]
    pattern = callee.attrs.get("op_pattern") if isinstance(callee, tirx.PrimFunc) and callee.attrs else None
    if pattern is None or int(pattern) > BROADCAST:
        return False
    size = _elements(var)
    for arg in call.args[1].fields:
        if arg.same_as(var) or not isinstance(arg.ty, relax.TensorType):
            continue
        other = _elements(arg)
        if other is None or (size is not None and other >= size):
            return False
    return True


class ReshapesJoin:
    """The `pricer` of RelabelMatmulEpilogues on the CPU: a reshape of static size whose readers are
    all light element-wise ops pays (module docstring), any other copy does not."""

    def pays(self, mod: tvm.IRModule, path: list, copy: relax.Call, out: relax.Var) -> bool:
        """Whether `copy` (a call_tir of a pure copy writing `out`) joins the compute kernel of `path`."""
        if copy_kind(mod[copy.args[0]]) != "reshape" or _elements(out) is None:
            return False
        readers = _readers(mod, out)
        return bool(readers) and all(_light_element_wise(mod, call, out) for call in readers)
