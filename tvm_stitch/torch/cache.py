"""The compile cache: built executables keyed by the graph's structure, the input specs, the target and options.

The key is a SHA-256 of the graph's code (its ops, their arguments and
order; aot_autograd names nodes deterministically), the bytes of the
tensors the graph holds as attributes (they are built into the module),
each input's dtype, device and shape (symbolic sizes by name, with their
bounds), the target and the build options. Weights are inputs of
aot_autograd's graphs, so two models of one architecture share a build.

In memory per Backend; on disk too where a directory is given
(`TVM_STITCH_CACHE_DIR`): `<key>.so`, written by `export_library`, read
back with `tvm.runtime.load_module`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import tvm

from tvm_stitch.torch import symbols


@dataclass
class Counters:
    """What a backend did: TVM builds, builds found in memory or on disk, (sub)graphs run on eager."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0  # the part of cache_hits read from TVM_STITCH_CACHE_DIR
    eager_fallbacks: int = 0


def graph_key(gm, example_inputs, target, options) -> str:
    """The cache key of a graph built for `target` with `options` (a hashable description)."""
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
    return digest.hexdigest()


def _spec(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"tensor({value.dtype},{value.device.type},{[str(symbols.expression(s)) for s in value.shape]})"
    return f"{type(value).__name__}({symbols.expression(value)})"


class CompileCache:
    """Executables by key, in memory and (where `directory` is set) on disk."""

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self.memory = {}

    def get(self, key: str):
        """(executable, "memory" | "disk") or (None, None)."""
        if key in self.memory:
            return self.memory[key], "memory"
        path = self._path(key)
        if path is not None and os.path.exists(path):
            self.memory[key] = tvm.runtime.load_module(path)
            return self.memory[key], "disk"
        return None, None

    def put(self, key: str, executable) -> None:
        self.memory[key] = executable
        path = self._path(key)
        if path is not None:
            os.makedirs(self.directory, exist_ok=True)
            partial = f"{path}.{os.getpid()}.tmp.so"
            executable.export_library(partial)
            os.replace(partial, path)  # readers never see a half-written library

    def _path(self, key: str) -> str | None:
        return os.path.join(self.directory, f"{key}.so") if self.directory else None
