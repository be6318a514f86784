"""The compile cache: built executables keyed by the graph, the input specs, the target, options and versions.

The key is a SHA-256 of the graph's code (its ops, their arguments and
order; aot_autograd names nodes deterministically), the bytes of the
tensors the graph holds as attributes (they are built into the module),
each input's dtype, device and shape (symbolic sizes by name, with their
bounds), the target, the build options and the versions of tvm-stitch
(with a digest of its files), TVM and tvm-ffi. Weights are inputs of
aot_autograd's graphs, so two models of one architecture share a build.

In memory per Backend; on disk too where a directory is given
(`TVM_STITCH_CACHE_DIR`): a trusted store of verified entries
(cache_store, cache_manifest, cache_trust).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tvm_stitch.torch import symbols
from tvm_stitch.torch.cache_manifest import Versions, current_versions
from tvm_stitch.torch.cache_store import DiskStore


@dataclass
class Counters:
    """What a backend did: TVM builds, builds found in memory or on disk, (sub)graphs run on eager."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0  # the part of cache_hits read from TVM_STITCH_CACHE_DIR
    eager_fallbacks: int = 0


def graph_key(gm, example_inputs, target, options, versions: Versions) -> str:
    """The cache key of a graph built for `target` with `options` (a hashable description) by `versions`."""
    import torch

    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    env = symbols.shape_env_of(example_inputs)
    for value in example_inputs:
        digest.update(_spec(value).encode())
        for size in getattr(value, "shape", ()):
            if symbols.is_symbolic(size):
                digest.update(str(symbols.bounds(env, [str(s) for s in symbols.expression(size).free_symbols]))
                              .encode())
    digest.update(str(target).encode())
    digest.update(repr(options).encode())
    digest.update(repr(versions).encode())
    return digest.hexdigest()


def _spec(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"tensor({value.dtype},{value.device.type},{[str(symbols.expression(s)) for s in value.shape]})"
    return f"{type(value).__name__}({symbols.expression(value)})"


class CompileCache:
    """Executables by key, in memory and (where `directory` is set) in a DiskStore there."""

    def __init__(self, directory: str | None = None):
        self.versions = current_versions()
        self.memory = {}
        self.disk = DiskStore(directory, self.versions) if directory else None

    def get(self, key: str, target):
        """(executable, "memory" | "disk") or (None, None)."""
        if key in self.memory:
            return self.memory[key], "memory"
        executable = self.disk.load(key, str(target)) if self.disk is not None else None
        if executable is None:
            return None, None
        self.memory[key] = executable
        return executable, "disk"

    def put(self, key: str, target, executable) -> None:
        self.memory[key] = executable
        if self.disk is not None:
            self.disk.save(key, str(target), executable)
