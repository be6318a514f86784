"""Which copies after a matmul or convolution join its kernel on the CPU: reshapes only.

On llvm, RelabelMatmulEpilogues (fusion/matmul_epilogue.py) runs with this
policy: a reshape between a matmul and its element-wise consumers (a
Linear on 4-D activations: matmul, bias, reshape back to 4-D, GELU,
reshape to 2-D for the next Linear) is relabelled, so the bias and GELU
join the matmul's kernel and run on its output tile
(schedules/cpu/contraction.py) instead of a pass of their own over the
whole output. Transposes and broadcasts keep their labels: on the CPU
they stay with the stitched kernels that read them.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_stitch.fusion.matmul_epilogue import copy_kind


class ReshapesJoin:
    """The `pricer` of RelabelMatmulEpilogues on the CPU: a reshape pays, any other copy does not."""

    def pays(self, mod: tvm.IRModule, path: list, copy: relax.Call, out: relax.Var) -> bool:
        """Whether `copy` (a call_tir of a pure copy) joins the compute kernel of `path`."""
        return copy_kind(mod[copy.args[0]]) == "reshape"
