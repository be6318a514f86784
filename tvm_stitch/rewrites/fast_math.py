"""Fast math on the CPU: transcendental ops legalized to vectorisable TE expressions.

libm's `exp`, `erf`, `tanh` and `log` are scalar calls that LLVM does not
vectorise. This pass replaces, in every Relax function, the ops models
bring by TE expressions built on TVM's polynomial approximations
(`topi.fast_exp`, `fast_erf`, `fast_tanh`, `nn.fast_softmax`), before
LegalizeOps:

    exp, erf, tanh, softmax      TVM's fast versions (as FastMathTransform)
    nn.gelu                      x/2 (1 + erf(x / sqrt 2))
    nn.gelu_tanh                 x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    sigmoid, nn.silu             1 / (1 + exp(-x)), x * sigmoid(x)
    nn.softplus                  max(x, 0) + log1p(exp(-|x|)) (beta, threshold as the op's)

with softplus's log1p a Cephes-style polynomial on [0, 1]. Only float32
tensors are rewritten (on llvm AccumulateInFloat32 widens half precision
first); other calls, calls of functions (GlobalVars) included, stay as
they are. The max relative errors are measured in tests/test_fast_math.py.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, topi
from tvm.relax import Call, Expr, PyExprMutator, expr_functor

from tvm_stitch.rewrites.rebind import each_function

# Cephes' logf polynomial: (log(1 + x) - x + x^2/2) / x^3 for |x| < sqrt(2) - 1, highest power first.
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def _log1p_0_to_1(u: te.Tensor) -> te.Tensor:
    """log(1 + u) for u in [0, 1]: 1 + u = 2^e (1 + x) with x in [sqrt(1/2) - 1, sqrt(2) - 1), then a
    polynomial in x. x is formed from u without rounding 1 + u (u itself, or (u - 1) / 2), so tiny u
    keep their relative accuracy."""

    def one(*idx):
        v = u(*idx)
        big = v >= math.sqrt(2.0) - 1.0
        e = tvm.tirx.Select(big, tvm.tirx.const(1.0, "float32"), tvm.tirx.const(0.0, "float32"))
        x = tvm.tirx.Select(big, (v - 1.0) * 0.5, v)
        z = x * x
        p = tvm.tirx.const(_LOG_POLY[0], "float32")
        for c in _LOG_POLY[1:]:
            p = p * x + c
        y = p * x * z - 2.12194440e-4 * e - 0.5 * z
        return x + y + 0.693359375 * e

    return te.compute(u.shape, one, name="fast_log1p")


def _sigmoid(x: te.Tensor) -> te.Tensor:
    e = topi.fast_exp(topi.negative(x))
    return te.compute(x.shape, lambda *i: 1.0 / (1.0 + e(*i)), name="fast_sigmoid")


def _silu(x: te.Tensor) -> te.Tensor:
    s = _sigmoid(x)
    return te.compute(x.shape, lambda *i: x(*i) * s(*i), name="fast_silu")


def _gelu(x: te.Tensor) -> te.Tensor:
    scaled = te.compute(x.shape, lambda *i: x(*i) * (1.0 / math.sqrt(2.0)), name="gelu_scaled")
    e = topi.fast_erf(scaled)
    return te.compute(x.shape, lambda *i: x(*i) * 0.5 * (1.0 + e(*i)), name="fast_gelu")


def _gelu_tanh(x: te.Tensor) -> te.Tensor:
    inner = te.compute(x.shape, lambda *i: math.sqrt(2.0 / math.pi) * (x(*i) + 0.044715 * x(*i) * x(*i) * x(*i)),
                       name="gelu_inner")
    t = topi.fast_tanh(inner)
    return te.compute(x.shape, lambda *i: x(*i) * 0.5 * (1.0 + t(*i)), name="fast_gelu_tanh")


def _softplus(x: te.Tensor, beta: float, threshold: float) -> te.Tensor:
    """log(1 + exp(beta x)) / beta as max(beta x, 0) + log1p(exp(-|beta x|)), over beta; x itself
    where beta x > threshold (as relax.nn.softplus)."""
    bx = te.compute(x.shape, lambda *i: x(*i) * beta, name="softplus_scaled")
    u = topi.fast_exp(te.compute(x.shape, lambda *i: -tvm.tirx.abs(bx(*i)), name="softplus_neg_abs"))
    log1p = _log1p_0_to_1(u)

    def one(*i):
        value = (tvm.tirx.max(bx(*i), 0.0) + log1p(*i)) / beta
        return tvm.tirx.Select(bx(*i) > threshold, x(*i), value)

    return te.compute(x.shape, one, name="fast_softplus")


def _is_float32(expr: Expr) -> bool:
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and ty.dtype == "float32"


@expr_functor.mutator
class _FastMathRewriter(PyExprMutator):
    def visit_call_(self, call: Call) -> Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args or not _is_float32(call.args[0]):
            return call
        name, x, bb = call.op.name, call.args[0], self.builder_
        if name == "relax.nn.softmax":
            return bb.call_te(topi.nn.fast_softmax, x, call.attrs.axis)
        simple = {"relax.exp": topi.fast_exp, "relax.erf": topi.fast_erf, "relax.tanh": topi.fast_tanh,
                  "relax.sigmoid": _sigmoid, "relax.nn.silu": _silu, "relax.nn.gelu": _gelu,
                  "relax.nn.gelu_tanh": _gelu_tanh}
        if name in simple:
            return bb.call_te(simple[name], x)
        if name == "relax.nn.softplus":
            return bb.call_te(_softplus, x, float(call.attrs.beta), float(call.attrs.threshold))
        return call


@tvm.transform.module_pass(opt_level=0, name="FastMath")
class FastMath:
    """Replace exp, erf, tanh, softmax, gelu, gelu_tanh, sigmoid, silu and softplus by vectorisable
    approximations (the module docstring lists the forms)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return each_function(_FastMathRewriter(mod), mod)
