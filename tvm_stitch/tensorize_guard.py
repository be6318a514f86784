"""Keep dlight's tensor-core Matmul rule off a path that kills the process in TVM 0.27.

dlight's `Matmul` rule hands a float16 GEMM whose static M, N and K all
exceed 64 to `MatmulTensorization`, which calls `sch.tensorize`. TVM 0.27's
`s_tir::Tensorize` starts by deep-copying the intrinsic's implementation
through `ffi::ToJSONGraph` / `FromJSONGraph` (blockize_tensorize.cc,
`DeepCopy(intrin->impl)`), before any pattern matching. With apache-tvm
0.27.0.post1 and apache-tvm-ffi 0.1.15.post2, `ToJSONGraph` segfaults on
every IR node (`tvm.ir.save_json` of an IntImm, a PrimType, a Range or a
TIR Var dies the same way), so every tensorization faults, whatever the
shape or the intrinsic; K <= 64 and bfloat16 only build because dlight
never tensorizes them. A segfault cannot be caught, so the rule is switched
off before it runs: every PrimFunc gets dlight's own opt-out attribute
`dlight.do_not_tensorize`, and dlight's Matmul rule then schedules the GEMM
on the SIMT cores (its non-tensorized path, the one float32 and bfloat16
GEMMs take anyway).
"""

from __future__ import annotations

import tvm
from tvm import tirx

NO_TENSORIZE = "dlight.do_not_tensorize"


def without_tensorize(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with dlight's opt-out of its tensor-core rules set."""
    if func.attrs is not None and NO_TENSORIZE in func.attrs:
        return func
    return func.with_attr(NO_TENSORIZE, True)


@tvm.transform.module_pass(opt_level=0, name="NoTensorize")
class NoTensorize:
    """Every PrimFunc of the module opted out of dlight's tensor-core rules (see the module's docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {gv: without_tensorize(func) for gv, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc)}
        for gv, func in updates.items():
            if not func.same_as(mod[gv]):
                mod[gv] = func
        return mod
