"""Dynamo's DDP graph splitter given DDP's own first bucket size when a tvm_stitch backend compiles.

With `optimize_ddp` on (its default, "ddp_optimizer"), dynamo splits a
DDP model's graph at DDP's bucket boundaries (`DDPOptimizer`), so that
each bucket's all-reduce can start while the backward of earlier graphs
runs. PyTorch 2.13 builds that splitter with the bucket size of the DDP
module but the first bucket's size of DDP's *default*
(`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB), whatever the
module was given: DDP itself uses `bucket_cap_mb` for its first bucket
too when the user sets it. A DDP module with `bucket_cap_mb` under 1 MiB
then fails before any backend runs, with "AssertionError: First bucket
should be smaller/equal to other buckets to get comms warmed up ASAP".

`follow_ddp_first_bucket()` (called when `tvm_stitch.torch` is imported,
which `backend="tvm_stitch"` does) replaces dynamo's `DDPOptimizer` by a
subclass that, for tvm_stitch backends only, passes the first bucket
size the active DDP module itself uses; other backends get PyTorch's
behaviour unchanged.
"""

from __future__ import annotations

WRAPPERS = 8  # at most this many layers of wrappers around a backend are looked through


def follow_ddp_first_bucket() -> None:
    """Install the subclass once (nothing where torch.distributed is not built)."""
    try:
        import torch
        from torch._dynamo.backends import distributed
    except ImportError:
        return
    if not torch.distributed.is_available() or getattr(distributed.DDPOptimizer, "follows_ddp_first_bucket", False):
        return
    distributed.DDPOptimizer = _with_ddp_first_bucket(distributed.DDPOptimizer)


def _with_ddp_first_bucket(base):
    class DDPOptimizer(base):
        __doc__ = base.__doc__
        follows_ddp_first_bucket = True

        def __init__(self, bucket_bytes_cap, backend_compile_fn, first_bucket_cap=None):
            if first_bucket_cap is None and is_tvm_stitch(backend_compile_fn):
                first_bucket_cap = ddp_first_bucket_bytes(bucket_bytes_cap)
            super().__init__(bucket_bytes_cap, backend_compile_fn, first_bucket_cap)

    return DDPOptimizer


def is_tvm_stitch(compile_fn) -> bool:
    """Whether `compile_fn` is a tvm_stitch backend (a Backend, or the entry point's function), seen through
    dynamo's and torch.compile's wrappers (which keep what they wrap as `_torchdynamo_orig_backend` and
    `compiler_fn`)."""
    for _ in range(WRAPPERS):
        inner = getattr(compile_fn, "_torchdynamo_orig_backend", None) or getattr(compile_fn, "compiler_fn", None)
        if inner is None:
            break
        compile_fn = inner
    module = getattr(compile_fn, "__module__", None) or type(compile_fn).__module__
    return module == "tvm_stitch" or module.startswith("tvm_stitch.")


def ddp_first_bucket_bytes(bucket_bytes_cap: int) -> int:
    """The first bucket's size of the DDP module being traced (DDP's default where it records none),
    at most `bucket_bytes_cap`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    module = DistributedDataParallel._get_active_ddp_module()
    config = getattr(module, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", None)
    return min(first if first is not None else torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, bucket_bytes_cap)
