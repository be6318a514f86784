"""A copy after a matmul or convolution (a relabelled epilogue) priced against the two apart (CUDA).

Relabelled element-wise (rewrites/matmul_epilogue.py), a transpose, reshape
or expand_dims after a compute kernel joins it: FuseOps and FuseTIR make
one PrimFunc of the two, and dlight schedules that PrimFunc as a whole,
which may be slower than the compute kernel alone (a depthwise convolution
with a transpose in its output stage is no longer one block per output).
Each epilogue is priced as fold_price.py prices a prologue: the compute
kernel with the path from it to the copy fused (what FuseOps and FuseTIR
make of them, composed the same way), against the compute kernel with the
path alone plus the copy as a streaming kernel (its input and output moved
once at the achievable bandwidth, one launch).
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_stitch.pricing.fold_price import FoldPrice, fold_price
from tvm_stitch.rewrites.host_constants import static_tensor_bytes
from tvm_stitch.rewrites.matmul_composition import compose_calls, composition_wiring
from tvm_stitch.stitch_target import StitchTarget


class EpiloguePricer:
    """Whether each relabelled epilogue pays; one pricing per distinct composition (the layers of a
    model share them), each refusal a note in `report` (a StitchReport) once."""

    def __init__(self, target, report=None):
        made = StitchTarget.of(target)
        self.target = made.target
        self.spec = made.spec if made.builds_cuda else None
        self.report = report
        self.prices: dict = {}  # composition wiring key -> FoldPrice

    def pays(self, mod: tvm.IRModule, path: list, copy: relax.Call, out: relax.Var) -> bool:
        """Whether `copy` (writing `out`) joins the kernel of `path` ([(var, call)] from the compute
        call on, each reading the one before): fused it is not modeled slower, or it cannot be priced."""
        if self.spec is None or self.spec.hbm_bytes_per_us <= 0:
            return True
        key, leaves = composition_wiring(copy, path)
        if key not in self.prices:
            self.prices[key] = self._price(mod, path, copy, out, leaves)
            price = self.prices[key]
            if not price.pays and self.report is not None:
                self.report.notes.append(
                    f"{copy.args[0].name_hint} stays a kernel after {path[0][1].args[0].name_hint}: fused, modeled "
                    f"{price.folded_us:.1f} us; apart {price.apart_us:.1f} us (dlight schedules the two as one slower)")
        return self.prices[key].pays

    def _price(self, mod: tvm.IRModule, path: list, copy: relax.Call, out: relax.Var, leaves: list) -> FoldPrice:
        sizes = [static_tensor_bytes(copy.args[1].fields[0].ty), static_tensor_bytes(out.ty)]
        if None in sizes:  # symbolic: the streaming copy cannot be priced, so neither is the choice
            return FoldPrice(-1.0, -1.0)
        try:
            fused, _ = compose_calls(mod, copy, path, leaves)
            alone = _compute_alone(mod, path)
        except (RuntimeError, TypeError, ValueError):  # FuseTIR refused the composition: not priced
            return FoldPrice(-1.0, -1.0)
        return fold_price(fused, alone, sum(sizes), self.target, self.spec)


def _compute_alone(mod: tvm.IRModule, path: list):
    """The PrimFunc FuseOps makes of `path` without the copy: the compute kernel and its path."""
    (_, last), before = path[-1], path[:-1]
    if not before:
        return mod[last.args[0]]
    _, leaves = composition_wiring(last, before)
    return compose_calls(mod, last, before, leaves)[0]
