"""Independent stitching: kernels with no data dependence packed into one launch.

Each member is a scheduled PrimFunc whose root body is one loop over its
row tasks (bound to `blockIdx.x` on CUDA, parallel on the CPU) with the same
thread-block shape. The packed kernel loops over the concatenated task
ranges; task `t` runs member k's body for task `t - offset_k` when
`offset_k <= t < offset_k + tasks_k`. Parameters and on-chip allocations
are the members', side by side; a kernel packed more than once (one update
applied to several tensors of one shape) gets fresh variables and buffers
for each further copy.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx


def _top_loop(func: tirx.PrimFunc):
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        raise ValueError("kernel body is not a root block")
    loop = realize.block.body
    if not isinstance(loop, tirx.For):
        raise ValueError("kernel is not one loop over its row tasks")
    return realize.block, loop


def loop_signature(func: tirx.PrimFunc) -> tuple:
    """What must match for two kernels to share a launch: the top loop's kind and binding."""
    _, loop = _top_loop(func)
    tag = loop.thread_binding.thread_tag if loop.thread_binding is not None else ""
    return (int(loop.kind), str(tag))


def pack(funcs: list, n_outputs: list) -> tirx.PrimFunc:
    """One PrimFunc that runs every kernel of `funcs`, each on its own range of tasks.

    `n_outputs[k]`: how many of kernel k's trailing parameters are outputs. The
    packed kernel takes every member's inputs (symbolic sizes among them, as
    scalars), then every member's outputs (the `call_tir` convention). A
    member's number of tasks may be symbolic: the ranges then start at
    symbolic offsets.
    """
    _, first_loop = _top_loop(funcs[0])
    dtype = str(first_loop.extent.ty)
    task = tirx.Var("task", dtype)
    inputs, outputs, allocs, branches = [], [], [], []
    offset = tirx.const(0, dtype)
    seen: list = []
    for func, n_out in zip(funcs, n_outputs):
        if any(func.same_as(other) for other in seen):
            func = s_tir.renew_defs(func)
        else:
            seen.append(func)
        root, loop = _top_loop(func)
        if loop_signature(func) != loop_signature(funcs[0]):
            raise ValueError("kernels with different launch shapes cannot share a launch")
        old = loop.loop_var
        shifted = task - offset if not _is_zero(offset) else task
        body = tvm_ffi.structural_map(loop.body, (tirx.Var, lambda v, old=old, new=shifted: new if v.same_as(old) else v))
        extent = loop.extent if str(loop.extent.ty) == dtype else tirx.Cast(dtype, loop.extent)
        offset = _simplified(offset + extent)
        branches.append((offset, body))
        inputs.extend(func.params[: len(func.params) - n_out])
        outputs.extend(func.params[len(func.params) - n_out:])
        allocs.extend(root.alloc_buffers)
    stmt = branches[-1][1]
    for end, body in reversed(branches[:-1]):
        stmt = tirx.IfThenElse(task < end, body, stmt)
    binding = None
    if first_loop.thread_binding is not None:
        old = first_loop.thread_binding
        binding = tirx.IterVar(tvm.ir.Range(tirx.const(0, dtype), offset), task, old.iter_type, old.thread_tag)
    loop = tirx.For(task, tirx.const(0, dtype), offset, first_loop.kind, stmt, thread_binding=binding)
    root = s_tir.SBlock([], [], [], "root", loop, alloc_buffers=allocs)
    attrs = {k: v for k, v in funcs[0].attrs.items() if k != "tvm_stitch.plan"} if funcs[0].attrs else {}
    attrs["tvm_stitch.packed"] = len(funcs)
    return tirx.PrimFunc(inputs + outputs, s_tir.SBlockRealize([], True, root)).with_attrs(attrs)


def _is_zero(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value == 0


def _simplified(expr):
    """Constant offsets stay constants (static members pack exactly as before)."""
    return sym.Analyzer().simplify(expr)
