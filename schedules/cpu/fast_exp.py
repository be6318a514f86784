"""exp of a float32 TIR expression as TVM's `topi.fast_exp` computes it: `2^n * p(f)` with
`x = n ln 2 + f`, a degree-7 polynomial `p` and `2^n` made from the exponent bits. Every step is a
vector instruction, so a vectorised loop stays vectorised (libm's `expf`, what `tirx.exp` becomes
on llvm, is a scalar call per lane). Inputs below -88.38 give 0, above 88.38 the largest value."""

from __future__ import annotations

from tvm import tirx

X_HI, X_LO = 88.3762626647950, -88.3762626647949
LOG2E, LN2 = 1.44269504088896341, 0.6931471805599453
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def fast_exp(value):
    """e^value (float32 TIR expression)."""

    def c(number):
        return tirx.const(number, "float32")

    v, x, n, f = (tirx.Var(name, "float32") for name in ("v", "x", "n", "f"))
    p = c(POLY[0])
    for coefficient in POLY[1:]:
        p = p * f + c(coefficient)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n + c(127.0)), tirx.const(23, "int32")))
    body = tirx.Let(f, x - n * c(LN2), tirx.max(two_n * (p * f * f + f + c(1.0)), v))
    body = tirx.Let(n, tirx.floor(x * c(LOG2E) + c(0.5)), body)
    return tirx.Let(v, value, tirx.Let(x, tirx.max(tirx.min(v, c(X_HI)), c(X_LO)), body))
