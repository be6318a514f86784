"""Seeded random inputs for a PrimFunc, in the ranges its ops accept.

Floats are drawn signed first (so that max/min identities, signs and
cancellation are exercised); `positive_inputs` gives the second try, in
[0.5, 1.5], for kernels whose reference is not finite on signed data (log,
sqrt, rsqrt, power of a negative base). Integer parameters used as indices
(a gather, `nll_loss`'s labels) are drawn within the extent of the axis they
index; other integers and booleans in {0, 1}.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_stitch.simt.symbolic_sizes import concrete


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype for a TVM dtype name (bfloat16 from ml_dtypes, a dependency of TVM)."""
    return np.dtype(ml_dtypes.bfloat16) if str(name) == "bfloat16" else np.dtype(str(name))


def written_params(func: tirx.PrimFunc) -> list:
    """Indices of the parameters some block, or a store outside blocks, writes (the call_tir outputs)."""
    written = set()

    def visit(block):
        for region in block.writes:
            written.add(region.source)

    def visit_store(store):
        written.add(store.buffer)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="pre")
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, visit_store), order="pre")
    return [i for i, p in enumerate(func.params) if any(p.same_as(w) for w in written)]


def index_bounds(func: tirx.PrimFunc, values: dict | None = None) -> dict:
    """Parameter index -> exclusive upper bound, for integer parameters whose values index an axis.

    An axis of symbolic extent bounds them where `values` gives its variables.
    """
    params = list(func.params)
    bounds = {}

    def loads_in(expr) -> list:
        found = []

        tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, lambda load: found.append(load.source)), order="pre")
        return found

    def visit(load):
        shape = load.source.ty.shape
        for axis, index in enumerate(load.indices):
            if axis >= len(shape):
                continue
            try:
                extent = concrete(shape[axis], values or {})
            except ValueError:
                continue
            for buffer in loads_in(index):
                k = next((i for i, p in enumerate(params) if p.same_as(buffer)), None)
                if k is not None:
                    bounds[k] = min(bounds.get(k, extent), extent)

    tvm_ffi.structural_walk(func.body, (tvm.ir.TensorLoad, visit), order="pre")
    return bounds


def concrete_shape(param, values: dict | None = None) -> tuple:
    """A buffer parameter's shape with its symbolic variables at `values` (name -> int)."""
    return tuple(concrete(d, values or {}) for d in param.ty.shape)


def random_inputs(func: tirx.PrimFunc, seed: int, positive: bool = False, values: dict | None = None) -> dict:
    """Parameter index -> numpy array, for every buffer parameter that is not written.

    `values`: the symbolic variables' values (name -> int) that fix the shapes.
    """
    rng = np.random.default_rng(seed)
    outputs = set(written_params(func))
    bounds = index_bounds(func, values)
    arrays = {}
    for i, param in enumerate(func.params):
        if i in outputs or not isinstance(param.ty, tirx.BufferType):
            continue
        dtype = str(param.ty.dtype)
        shape = concrete_shape(param, values)
        if dtype == "bool":
            arrays[i] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            arrays[i] = rng.integers(0, bounds.get(i, 2), shape).astype(dtype)
        else:
            low, high = (0.5, 1.5) if positive else (-1.0, 1.0)
            arrays[i] = rng.uniform(low, high, shape).astype(numpy_dtype(dtype))
    return arrays
