"""Proof that a scheduled kernel lowers and generates code for its target.

Some schedules are accepted by s_tir but rejected later by TIR lowering
(e.g. a barrier that would sit inside a thread predicate). The stitch pass
builds each new kernel on its own before using it, so such a kernel falls
back to TVM's default path instead of failing the user's build.

On llvm the check runs TVM's TIR lowering, host finalisation and LLVM's
code generation with LLVM's optimisation off (`opt-level` 0): the
translation to LLVM IR is where TVM rejects an intrinsic it cannot lower
(`unknown intrinsic`: a vectorised `cosh` before schedules/intrinsics expanded
it), and LLVM's optimisation, most of a CPU kernel's compile time, is paid
once, by the real build (the cost of the check on the models:
docs/op-coverage.md). On a GPU target it runs the same lowering and
generates the device code (where CUDA's own rejections are), but not the
host stub's LLVM code: the host side of a kernel is TVM's packed-call
wrapper, the same for every kernel (BERT's Adam step on CUDA at bench
size: 10 checks took 1.9 s with it, 0.4 s without). What no check here
sees is nvcc's own verdict on the CUDA source (`tvm.compile` does not run
nvcc either; schedules/cuda/vector_selects handles the one known case).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target
from tvm.tirx.build import codegen_build, split_host_device_mods


class UnboundBlockError(RuntimeError):
    """A block of a GPU kernel is outside every thread-bound loop: it would run on the host."""


def check_bound(func: tirx.PrimFunc) -> None:
    """Every block of a GPU PrimFunc sits under a loop bound to blockIdx.* or threadIdx.*."""
    sch = s_tir.Schedule(func)
    stack = list(sch.get_child_blocks(get_root_block(sch)))
    while stack:
        block = stack.pop()
        loops = sch.get_loops(block)
        if not any(sch.get(loop).kind == tirx.ForKind.THREAD_BINDING for loop in loops):
            raise UnboundBlockError(f"block {sch.get(block).name_hint} is not under a thread-bound loop")
        stack.extend(sch.get_child_blocks(block))


def _unoptimised(target: Target) -> Target:
    """`target` with LLVM's optimisation off: the same code generation, without the optimiser's time."""
    return Target({**{k: v for k, v in target.export().items() if k != "opt-level"}, "opt-level": 0})


def check_builds(func: tirx.PrimFunc, target: Target) -> None:
    """Raise (TVM raises RuntimeError subclasses) if `func` does not lower (llvm) or build (CUDA)
    for `target`, or, for a GPU, if some block would run on the host."""
    if target.kind.name == "cuda":
        check_bound(func)
    name = "stitch_check"
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    if target.kind.name == "llvm":
        lower, finalize_host, _ = tvm.tirx.get_default_tir_pipeline(target)
        host_mod = finalize_host()(lower(tvm.tirx.transform.BindTarget(target.with_host(target))(mod)))
        codegen_build(host_mod, _unoptimised(target))
        return
    host = target.host if target.host is not None else Target("llvm")
    lower, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    host_mod, device_mods = split_host_device_mods(lower(tvm.tirx.transform.BindTarget(target.with_host(host))(mod)))
    finalize_host()(host_mod)
    for device_target, device_mod in device_mods.items():
        codegen_build(finalize_device()(device_mod), device_target)
