"""Proof that a scheduled kernel lowers and generates code for its target.

Some schedules are accepted by s_tir but rejected later by TIR lowering
(e.g. a barrier that would sit inside a thread predicate). The stitch pass
builds each new kernel on its own before using it, so such a kernel falls
back to TVM's default path instead of failing the user's build.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.target import Target


def check_builds(func: tirx.PrimFunc, target: Target) -> None:
    """Raise (TVM raises RuntimeError subclasses) if `func` does not build for `target`."""
    name = "stitch_check"
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    tvm.tirx.build(mod, target=target)
