"""`torch.compile(model, backend="tvm_stitch")`: PyTorch graphs built with the stitch pipeline, for inference and training.

    import torch
    compiled = torch.compile(model, backend="tvm_stitch")  # registered by the package's entry point
    compiled = torch.compile(model, backend=tvm_stitch.torch.backend(target=None, fast_math=False))
    tvm_stitch.torch.counters()  # the default backend's compiles, cache hits, eager fallbacks

See docs/torch-compile.md.
"""

from __future__ import annotations

import functools

from tvm_stitch.torch.dynamo_backend import Backend, Options
from tvm_stitch.torch.cache import Counters
from tvm_stitch.torch.cache_store import CacheWarning
from tvm_stitch.torch.ddp_buckets import follow_ddp_first_bucket
from tvm_stitch.torch.eager import EagerFallbackWarning

follow_ddp_first_bucket()  # DDP with buckets under 1 MiB (docs/distributed.md)


def backend(target=None, **options) -> Backend:
    """A backend with options: target (None: from the inputs' device), strict, fast_math, fusion, cache."""
    return Backend(target=target, **options)


@functools.cache
def default_backend() -> Backend:
    """The backend `backend="tvm_stitch"` uses: one per process, its cache and counters shared by every model."""
    return Backend()


def compile_graph(gm, example_inputs):
    """The `torch_dynamo_backends` entry point: the default backend."""
    return default_backend()(gm, example_inputs)


def counters() -> Counters:
    """What the default backend did so far (compiles, cache_hits, disk_hits, eager_fallbacks)."""
    return default_backend().counters


__all__ = ["backend", "Backend", "Options", "Counters", "CacheWarning", "EagerFallbackWarning", "default_backend",
           "compile_graph", "counters"]
