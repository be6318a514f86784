"""Half-precision graphs compute in float32 where the hardware would not.

A Relax pass run before legalization (and before the fast-math rewrite).
Every op in its set whose tensor inputs are float16 or bfloat16 gets them
cast to float32 and its result cast back, so the graph's dtypes stay as they
were; inside a stitched kernel the casts are inlined and the float32 values
live only in registers or per-row buffers.

- `AccumulateInFloat32()` (every target): reducing ops and transcendentals.
  Sums accumulate in float32, and polynomial approximations are evaluated in
  float32 (in float16 their small coefficients underflow).
- `AccumulateInFloat32(arithmetic=True)` (CPUs, which have no half-precision
  arithmetic: each op converts through float32 anyway): element-wise
  arithmetic too, and a cast to half precision that is only cast back to
  float32 is dropped. A chain of ops then reads half precision once,
  computes in float32 vectors and writes half precision once; its
  intermediate roundings to half precision go, so results are as accurate as
  or more accurate than the half-precision graph's.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator, expr_functor

from tvm_stitch.rewrites.rebind import each_function

LOW_PRECISION = ("float16", "bfloat16")
ACCUMULATING_OPS = frozenset(
    {
        "relax.sum", "relax.mean", "relax.prod", "relax.variance", "relax.std",
        "relax.nn.softmax", "relax.nn.log_softmax", "relax.nn.layer_norm", "relax.nn.rms_norm",
        "relax.nn.group_norm", "relax.nn.batch_norm", "relax.cumsum",
        "relax.exp", "relax.erf", "relax.tanh", "relax.sigmoid", "relax.log",
        "relax.power",  # a transcendental too; TIR's power also refuses bfloat16 (GPT-2's GELU, x ** 2 in backward)
    }
)
ARITHMETIC_OPS = ACCUMULATING_OPS | frozenset(
    {
        "relax.add", "relax.subtract", "relax.multiply", "relax.divide",
        "relax.maximum", "relax.minimum", "relax.negative", "relax.abs", "relax.square",
        "relax.sqrt", "relax.rsqrt", "relax.clip", "relax.where", "relax.max", "relax.min",
        "relax.sin", "relax.cos", "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh",
        "relax.nn.silu",
    }
)


def _low_precision(expr) -> str | None:
    ty = expr.ty if hasattr(expr, "ty") else None
    if isinstance(ty, relax.TensorType) and str(ty.dtype) in LOW_PRECISION:
        return str(ty.dtype)
    return None


def _float32(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "float32"


@expr_functor.mutator
class _Widen(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, ops: frozenset, drop_round_trips: bool):
        super().__init__(mod)
        self.ops = ops
        self.drop_round_trips = drop_round_trips

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        op = call.op
        if not isinstance(op, tvm.ir.Op) or op.name not in self.ops:
            return call
        dtypes = [_low_precision(a) for a in call.args]
        if not any(dtypes):
            return call
        if isinstance(call.ty, relax.TupleType):
            return self._widen_tuple(call, dtypes)
        out_dtype = _low_precision(call)
        if out_dtype is None:
            return call
        args = [self._as_float32(a) if d else a for a, d in zip(call.args, dtypes)]
        wide = self.builder_.normalize(relax.Call(op, args, call.attrs, call.ty_args))
        if not _float32(wide):
            return call
        return relax.op.astype(wide, out_dtype)

    def _widen_tuple(self, call: relax.Call, dtypes: list) -> relax.Expr:
        """An op of a tuple result (batch_norm: the output, moving mean and variance) in float32, the
        fields cast back. Left as it is, TOPI's batch_norm of half-precision tensors computes a float32
        output (its epsilon is a float32 constant) under Relax's half-precision type, and legalization
        re-types every reader of the field: a reader this pass made (a widened sum cast back) is then
        an op of mixed dtypes, which LegalizeOps rejects."""
        out_dtypes = [str(f.dtype) if isinstance(f, relax.TensorType) else None for f in call.ty.fields]
        if not any(d in LOW_PRECISION for d in out_dtypes):
            return call
        args = [self._as_float32(a) if d else a for a, d in zip(call.args, dtypes)]
        wide = self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
        wide_fields = wide.ty.fields if isinstance(wide.ty, relax.TupleType) else []
        if len(wide_fields) != len(out_dtypes) or any(
                d in LOW_PRECISION and not (isinstance(w, relax.TensorType) and str(w.dtype) == "float32")
                for d, w in zip(out_dtypes, wide_fields)):
            return call
        wide = self.builder_.emit(wide)
        fields = [relax.TupleGetItem(wide, i) for i in range(len(out_dtypes))]
        return relax.Tuple([self.builder_.emit(relax.op.astype(f, d)) if d in LOW_PRECISION else f
                            for f, d in zip(fields, out_dtypes)])

    def _as_float32(self, value: relax.Expr) -> relax.Expr:
        """astype(value, float32); with `drop_round_trips`, the float32 x itself if value = astype(x, half)."""
        if self.drop_round_trips:
            bound = self.lookup_binding(value) if isinstance(value, relax.Var) else value
            if (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op)
                    and bound.op.name == "relax.astype" and _float32(bound.args[0])):
                return bound.args[0]
        return relax.op.astype(value, "float32")


@tvm.transform.module_pass(opt_level=0, name="AccumulateInFloat32")
class AccumulateInFloat32:
    """Cast float16/bfloat16 inputs of reducing and transcendental ops (with `arithmetic`: of every
    element-wise arithmetic op too) to float32 and results back."""

    def __init__(self, arithmetic: bool = False):
        self.arithmetic = arithmetic

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = each_function(_Widen(mod, ARITHMETIC_OPS if self.arithmetic else ACCUMULATING_OPS, self.arithmetic), mod)
        return relax.transform.DeadCodeElimination()(mod) if self.arithmetic else mod
