"""Keep dlight's tensor-core Matmul rule off a path that kills the process with a mismatched tvm-ffi.

dlight's `Matmul` rule hands a float16 GEMM whose static M, N and K all
exceed 64 to `MatmulTensorization`, which calls `sch.tensorize`. TVM 0.27's
`s_tir::Tensorize` starts by deep-copying the intrinsic's implementation
through `ffi::ToJSONGraph` / `FromJSONGraph` (blockize_tensorize.cc,
`DeepCopy(intrin->impl)`), before any pattern matching.

apache-tvm 0.27.0.post1 is built against apache-tvm-ffi 0.1.14 and declares
`apache-tvm-ffi>=0.1.14.post0` with no upper bound. With apache-tvm-ffi
0.1.15 (0.1.15.post1, 0.1.15.post2) `ToJSONGraph` segfaults on every IR node
made by libtvm (`tvm.ir.save_json` of an IntImm dies taking a reference on
the address 0x100000001: a packed value read as an object pointer), so every
tensorization faults, whatever the shape or intrinsic. With 0.1.14.post0 and
0.1.14.post1 it serialises, and dlight's wmma schedule builds.

pyproject pins `apache-tvm-ffi<0.1.15`. Where the installed tvm-ffi is a
faulting release anyway (the pin bypassed), tensorization is switched off
before dlight's rules run: every PrimFunc gets dlight's own opt-out attribute
`dlight.do_not_tensorize`, and dlight's Matmul schedules the GEMM on the
SIMT cores (its non-tensorized path, the one bfloat16 GEMMs take anyway).
A segfault cannot be caught, so the fault is prevented, not handled.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx

NO_TENSORIZE = "dlight.do_not_tensorize"
# The first apache-tvm-ffi release whose ToJSONGraph faults on TVM 0.27's IR nodes.
FIRST_FAULTING_FFI = (0, 1, 15)


def ffi_release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.1.15.post2" -> (0, 1, 15)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part) for part in match.groups())


def tensorize_faults(ffi_version: str | None = None) -> bool:
    """Whether TVM's Tensorize would segfault with the installed (or the given) apache-tvm-ffi."""
    return ffi_release(ffi_version or tvm_ffi.__version__) >= FIRST_FAULTING_FFI


def without_tensorize(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with dlight's opt-out of its tensor-core rules set."""
    if func.attrs is not None and NO_TENSORIZE in func.attrs:
        return func
    return func.with_attr(NO_TENSORIZE, True)


@tvm.transform.module_pass(opt_level=0, name="NoTensorize")
class NoTensorize:
    """Where tensorization faults (`tensorize_faults`), every PrimFunc opted out of dlight's tensor-core
    rules; otherwise the module unchanged."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not tensorize_faults():
            return mod
        updates = {gv: without_tensorize(func) for gv, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc)}
        for gv, func in updates.items():
            if not func.same_as(mod[gv]):
                mod[gv] = func
        return mod
