"""The suite of memory-intensive graphs: one module per graph, its three forms side by side.

Each graph module holds the Relax graph (`relax_graph(rx, dtype, dims)`,
decomposed into primitive ops as frontends emit it), the inputs
(`inputs(rng, dtype, dims)`), the float64 numpy reference
(`numpy_reference(*inputs)`) and the PyTorch version (`torch_graph(*tensors)`,
written with tensor methods only). The graph modules import neither TVM nor
PyTorch: the Relax toolkit (relax_blocks.py) is handed to `relax_graph` when a
module is built, so the GPU check kit ships this package to a machine with
only TVM's runtime and PyTorch, where it is imported as `workloads`.

`SUITE` maps a name to a `SuiteGraph`; `SuiteGraph.build(dtype, dims)` gives
the Relax module at the benchmark size (`dims("bench")`) or a small one
(`dims("test")`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from . import (adam_update, attention_softmax, batchnorm_stats, bias_gelu, chained_reductions, cross_entropy, gemm,
               layernorm, layernorm_backward, layernorm_softmax, layernorm_stats, residual_layernorm, rmsnorm,
               softmax)

__all__ = ["SUITE", "EXTRA", "SIZES", "VARIANTS", "SuiteGraph", "dims", "graph", "variant_dims", "reference"]

SIZES = {
    # rows x columns of the main input per size class; short_*, long_*, bn_*: the shape variants
    "bench": {"rows": 4096, "cols": 768, "batch": 8, "heads": 12, "seq": 128, "vocab": 8192,
              "short_rows": 750000, "short_cols": 32, "long_rows": 64, "long_cols": 30000,
              "bn_batch": 32, "bn_heads": 4, "bn_seq": 224},
    "test": {"rows": 64, "cols": 96, "batch": 2, "heads": 3, "seq": 16, "vocab": 200,
             "short_rows": 300, "short_cols": 32, "long_rows": 4, "long_cols": 3000,
             "bn_batch": 2, "bn_heads": 1, "bn_seq": 20},
}

# Shape variants: a suite graph with some of its dims taken from other keys of the size class.
VARIANTS = {
    "softmax_short_rows": ("softmax", {"rows": "short_rows", "cols": "short_cols"}),
    "softmax_long_rows": ("softmax", {"rows": "long_rows", "cols": "long_cols"}),
    "layernorm_backward_short_rows": ("layernorm_backward", {"rows": "short_rows", "cols": "short_cols"}),
    "batchnorm_stats_resnet": ("batchnorm_stats", {"batch": "bn_batch", "heads": "bn_heads", "seq": "bn_seq"}),
}

_GRAPHS = (layernorm, layernorm_stats, rmsnorm, softmax, attention_softmax, bias_gelu, residual_layernorm,
           layernorm_softmax, cross_entropy, layernorm_backward, batchnorm_stats, adam_update, chained_reductions)


def dims(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, not {size!r}")
    return SIZES[size]


def variant_dims(d: dict, keys: dict) -> dict:
    """The dims of a shape variant: d with each key of `keys` set to d[keys[key]]."""
    return dict(d, **{key: d[source] for key, source in keys.items()})


@dataclass(frozen=True)
class SuiteGraph:
    """One suite graph: its module's forms, at the dims of a size class (a shape variant maps some)."""

    name: str
    description: str
    module: ModuleType
    keys: tuple = ()  # shape variant: (dim, dim it is taken from) pairs

    @property
    def dtypes(self) -> tuple:
        return getattr(self.module, "DTYPES", ("float32", "float16"))

    def dims(self, d: dict) -> dict:
        return variant_dims(d, dict(self.keys))

    def build(self, dtype: str, d: dict):
        """The Relax IRModule (imports TVM's compiler: not available on the GPU kit's machine)."""
        from . import relax_blocks

        return self.module.relax_graph(relax_blocks, dtype, self.dims(d))

    def inputs(self, rng, dtype: str, d: dict) -> list:
        return self.module.inputs(rng, dtype, self.dims(d))

    @property
    def reference(self):
        """(inputs as float64) -> numpy array or tuple."""
        return self.module.numpy_reference

    @property
    def torch(self):
        """(inputs as torch tensors) -> what the Relax graph returns."""
        return self.module.torch_graph


def _registry() -> dict:
    suite = {g.__name__.rsplit(".", 1)[-1]: SuiteGraph(g.__name__.rsplit(".", 1)[-1], g.DESCRIPTION, g)
             for g in _GRAPHS}
    for name, (base, keys) in VARIANTS.items():
        shape = ", ".join(f"{k} from {v}" for k, v in keys.items())
        suite[name] = SuiteGraph(name, f"{suite[base].description} ({shape})", suite[base].module,
                                 tuple(keys.items()))
    return suite


SUITE = _registry()
# Graphs outside the suite that the GPU check kit times (compute-intensive ones).
EXTRA = {"gemm": SuiteGraph("gemm", gemm.DESCRIPTION, gemm)}


def graph(name: str) -> SuiteGraph:
    """A suite graph or one of EXTRA, by name."""
    return SUITE[name] if name in SUITE else EXTRA[name]


def reference(graph: SuiteGraph, inputs: list) -> list:
    """numpy reference outputs in float64, as a list."""
    as64 = [a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
            for a in inputs]  # ml_dtypes' bfloat16 is of kind "V"
    out = graph.reference(*as64)
    return list(out) if isinstance(out, tuple) else [out]
