"""The plan of an accumulating scatter on CUDA (`scatter_nd(data, indices, updates, "add")`), as plain data.

An embedding's gradient is one: `out = data` (zeros), then for every index
tuple `i` and every element `r` of a row, `out[indices[i], r] += updates[i, r]`.
TVM's CUDA lowering gives each element of a row a thread that walks every
index tuple in order (repeated indices then never race): at BERT's bench
size 768 threads each walk 1024 tuples, a launch bound by the latency of
1024 dependent read-modify-writes. Here every (tuple, element) pair is a
thread of its own and adds with an atomic add (`atomicAdd`, whose result is
unused: a reduction at the L2, no round trip for the thread), so repeated
indices accumulate in whatever order their atomics arrive: the sums agree
with an ordered walk within float32 rounding, not bit for bit.

Two kernels: the first writes `out` (the constant `data` is made of, or a
copy of `data`), `vector` elements per thread; the second scatters, one
element per thread. An index outside its axis adds nothing (TVM's lowering
would write outside the output). The index tuples may be of symbolic count
(a batch, a sequence: the second kernel's grid is an expression of it); out
is static. Traffic and time are priced with the count at its upper bound
(`priced_at`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import DataType

from tvm_stitch.analysis.shape_dims import (at_values, ceil_div, is_static, priced_sizes, product, same, sizes_in, static,
                                           text)
from tvm_stitch.planning.reasons import PlanError
from tvm_stitch.planning.spec import TargetSpec

THREADS = 256  # per block, both kernels: 8 warps, any SM holds several such blocks


@dataclass(frozen=True)
class ScatterAddPlan:
    """One accumulating scatter: shapes, how `out` starts, and the launch of each kernel."""

    out_shape: tuple  # data's (and out's) shape
    index_shape: tuple  # (..., slots): each index tuple names `slots` leading axes of out
    dtype: str
    index_dtype: str
    init: str  # "fill": out starts as the constant `fill`; "copy": out starts as a copy of data
    fill: float
    threads: int
    vector: int  # elements per thread of the first kernel
    spec: TargetSpec
    priced_at: tuple = ()  # ((size name, value), ...): the symbolic sizes of the index tuples, priced there

    @property
    def tuples(self):
        """Index tuples: an int, or an expression of the symbolic sizes."""
        return product(self.index_shape[:-1])

    @property
    def slots(self) -> int:
        return self.index_shape[-1]

    @property
    def row_elements(self) -> int:
        """Elements each index tuple adds to: the product of out's axes after the indexed ones."""
        return math.prod(self.out_shape[self.slots:])

    @property
    def elements(self) -> int:
        return math.prod(self.out_shape)

    @property
    def init_blocks(self) -> int:
        return -(-self.elements // (self.threads * self.vector))

    @property
    def scatter_blocks(self):
        return ceil_div(self.tuples * self.row_elements, self.threads)

    def describe(self) -> str:
        start = f"fill {self.fill:g}" if self.init == "fill" else "copy of data"
        priced = f", priced at {', '.join(f'{n} = {v}' for n, v in self.priced_at)}" if self.priced_at else ""
        return (f"scatter-add {text(self.tuples)} x {self.row_elements} into {'x'.join(map(str, self.out_shape))} "
                f"{self.dtype}: {start} ({self.init_blocks} x {self.threads} threads, {self.vector} per thread), "
                f"atomic adds ({text(self.scatter_blocks)} x {self.threads} threads, one element each){priced}")

    def traffic(self) -> tuple:
        """(loaded, stored, ideal) bytes: the indices and updates read once, out written once (and
        data read for a copy); each atomic add reads and writes its element of out at most once
        from device memory (the L2 merges repeated ones)."""
        width = _bytes(self.dtype)
        tuples = at_values(self.tuples, dict(self.priced_at))
        indices = tuples * self.slots * _bytes(self.index_dtype)
        updates = tuples * self.row_elements * width
        out = self.elements * width
        touched = min(updates, out)
        data = out if self.init == "copy" else 0
        return indices + updates + data + touched, out + touched, indices + updates + data + out


def _bytes(dtype: str) -> int:
    return max(1, DataType(dtype).bits // 8)


def plan_scatter_add(out_shape: tuple, index_shape: tuple, updates_shape: tuple, dtype: str, index_dtype: str,
                     fill: float | None, spec: TargetSpec, bounds: dict | None = None) -> ScatterAddPlan:
    """The plan of `scatter_nd(data, indices, updates, "add")` for `spec` (CUDA); `fill`: the constant
    data is made of, None where data is any tensor; `bounds`: {size name: (lower, upper or None)} of the
    symbolic sizes (the Relax function's). PlanError where it cannot be planned."""
    if spec.family != "cuda":
        raise PlanError("scatter-target", family=spec.family)
    if dtype not in spec.atomic_add_dtypes:
        raise PlanError("scatter-dtype", dtype=dtype, arch=spec.arch)
    shapes = (out_shape, index_shape, updates_shape)
    if not static(out_shape) or not index_shape or not is_static(index_shape[-1]):
        raise PlanError("scatter-symbolic", shapes=str(shapes))
    slots = index_shape[-1]
    if not 1 <= slots <= len(out_shape) or not same(tuple(updates_shape), tuple(index_shape[:-1]) + out_shape[slots:]):
        raise PlanError("scatter-shapes", shapes=str(shapes))
    if math.prod(out_shape) == 0 or (static(index_shape) and math.prod(index_shape) == 0):
        raise PlanError("scatter-shapes", shapes=str(shapes))
    threads = min(THREADS, spec.max_threads_per_block)
    lanes = max(1, spec.vector_bytes // _bytes(dtype))
    vector = lanes if out_shape[-1] % lanes == 0 else 1  # a vector within one row of out
    return ScatterAddPlan(tuple(out_shape), tuple(index_shape), dtype, index_dtype,
                          "fill" if fill is not None else "copy", 0.0 if fill is None else float(fill),
                          threads, vector, spec, priced_sizes(sizes_in([index_shape]), bounds or {}))
