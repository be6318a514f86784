"""TVM Disco's collective functions over torch.distributed: a tensor-parallel Relax module runs in each rank.

Relax's collective ops (`R.ccl.allreduce`, `allgather`,
`broadcast_from_worker0`, `scatter_from_worker0`) legalize to calls of the
packed functions `runtime.disco.<name>(input, ..., output)`, which TVM
0.27 implements for the workers of a Disco session with NCCL or RCCL
only. `register()` replaces them (the registry's override) by functions
that run the collective on torch.distributed's default process group, so
a per-shard module built here runs in the processes of a torch job on any
backend torch has (gloo on the CPU, NCCL on GPUs). Tensors cross by
DLPack without copies; the whole world is the one group (`in_group` is
accepted and means it).
"""

from __future__ import annotations

REDUCTIONS = ("sum", "prod", "min", "max", "avg")  # Relax's op codes 0..4, in order


def register() -> None:
    """Make `runtime.disco.{allreduce, allgather, broadcast_from_worker0, scatter_from_worker0}` run on
    torch.distributed (its process group must be initialised before a module calls them)."""
    import tvm_ffi

    for name, function in (("allreduce", _allreduce), ("allgather", _allgather),
                           ("broadcast_from_worker0", _broadcast_from_worker0),
                           ("scatter_from_worker0", _scatter_from_worker0)):
        tvm_ffi.register_global_func(f"runtime.disco.{name}", function, override=True)


def _torch(tensor):
    import torch

    return torch.from_dlpack(tensor)


def _allreduce(tensor, op_code, in_group, out) -> None:
    import torch.distributed as dist

    kind = REDUCTIONS[int(op_code[0])]
    result = _torch(out)
    result.copy_(_torch(tensor))
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
          "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[kind]
    dist.all_reduce(result, op=op)
    if kind == "avg":  # gloo has no AVG: the sum over the world size
        result.div_(dist.get_world_size())


def _allgather(tensor, in_group, out) -> None:
    import torch.distributed as dist

    result = _torch(out)
    dist.all_gather(list(result.chunk(dist.get_world_size(), 0)), _torch(tensor).contiguous())


def _broadcast_from_worker0(tensor, in_group, out) -> None:
    import torch.distributed as dist

    result = _torch(out)
    result.copy_(_torch(tensor))
    dist.broadcast(result, src=0)


def _scatter_from_worker0(tensor, in_group, out) -> None:
    """`tensor` (on worker 0) is (world, *out's shape): worker i gets its i-th slice."""
    import torch.distributed as dist

    source = _torch(tensor)
    pieces = [piece.contiguous() for piece in source.unbind(0)] if dist.get_rank() == 0 else None
    dist.scatter(_torch(out), pieces, src=0)
