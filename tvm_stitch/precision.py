"""Reductions and transcendentals over float16/bfloat16 compute in float32.

A Relax pass run before legalization (and before the fast-math rewrite):
every reducing op, and every exp, erf, tanh, sigmoid and log, whose tensor
inputs are float16 or bfloat16 gets them cast to float32 and its result cast
back. Sums accumulate in float32, and polynomial approximations are
evaluated in float32 (in float16 their small coefficients underflow), while
the graph's dtypes stay as they were. Inside a stitched kernel the casts are
inlined: the float32 values live only in registers.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator, expr_functor

LOW_PRECISION = ("float16", "bfloat16")
ACCUMULATING_OPS = frozenset(
    {
        "relax.sum", "relax.mean", "relax.prod", "relax.variance", "relax.std",
        "relax.nn.softmax", "relax.nn.log_softmax", "relax.nn.layer_norm", "relax.nn.rms_norm",
        "relax.nn.group_norm", "relax.nn.batch_norm", "relax.cumsum",
        "relax.exp", "relax.erf", "relax.tanh", "relax.sigmoid", "relax.log",
    }
)


def _low_precision(expr) -> str | None:
    ty = expr.ty if hasattr(expr, "ty") else None
    if isinstance(ty, relax.TensorType) and str(ty.dtype) in LOW_PRECISION:
        return str(ty.dtype)
    return None


@expr_functor.mutator
class _Widen(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        op = call.op
        if not isinstance(op, tvm.ir.Op) or op.name not in ACCUMULATING_OPS:
            return call
        dtypes = [_low_precision(a) for a in call.args]
        if not any(dtypes):
            return call
        out_dtype = _low_precision(call)
        if out_dtype is None:
            return call
        args = [relax.op.astype(a, "float32") if d else a for a, d in zip(call.args, dtypes)]
        wide = self.builder_.normalize(relax.Call(op, args, call.attrs, call.ty_args))
        if not isinstance(wide.ty, relax.TensorType):
            return call
        return relax.op.astype(wide, out_dtype)


@tvm.transform.module_pass(opt_level=0, name="AccumulateInFloat32")
class AccumulateInFloat32:
    """Cast float16/bfloat16 inputs of reducing and transcendental ops to float32 and results back."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        widen = _Widen(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                widen.builder_.update_func(gv, widen.visit_expr(func))
        return widen.builder_.get()
