"""Fast math on the CPU: vectorisable exp, erf, tanh and the activations models bring (gelu,
gelu_tanh, sigmoid, silu, softplus), with their error measured against numpy."""

from math import erf, log1p, pi, sqrt

import numpy as np
import pytest
from tvm import relax

from tvm_stitch.tools.build import run_cpu
from tvm_stitch.pipeline import pipeline

from conftest import LLVM, make_module, tensor

# Largest relative error (|got - want| / max(|want|, 1e-3)) allowed on [-10, 10]. Measured on this
# project's machines (README): with fast math exp 5.6e-7, erf 3.2e-7, tanh 2.8e-7, sigmoid 1.2e-7,
# silu 6.3e-7, softplus 1.2e-7, gelu 9.1e-4 and gelu_tanh 7.4e-4 (both in the negative tail, where
# 1 + erf cancels: absolute errors below 1e-6); without it (libm, TVM's lowerings) exp and erf 6e-8,
# tanh 2.9e-6, sigmoid 1.2e-7, silu 1.6e-7, softplus 6.0e-5, gelu 8.2e-5, gelu_tanh 1.5e-4.
BOUNDS = {"exp": 1e-6, "erf": 1e-6, "tanh": 1e-6, "nn.gelu": 1e-3, "nn.gelu_tanh": 1e-3, "sigmoid": 1e-6,
          "nn.silu": 1e-6, "nn.softplus": 1e-6}
EXACT_BOUNDS = {"exp": 1e-7, "erf": 1e-7, "tanh": 5e-6, "nn.gelu": 1e-4, "nn.gelu_tanh": 2e-4, "sigmoid": 1e-6,
                "nn.silu": 1e-6, "nn.softplus": 1e-4}
X = np.linspace(-10.0, 10.0, 20001, dtype=np.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


REFERENCE = {
    "exp": np.exp, "erf": np.vectorize(erf), "tanh": np.tanh,
    "nn.gelu": lambda x: x * 0.5 * (1.0 + np.vectorize(erf)(x / sqrt(2.0))),
    "nn.gelu_tanh": lambda x: x * 0.5 * (1.0 + np.tanh(sqrt(2.0 / pi) * (x + 0.044715 * x**3))),
    "sigmoid": _sigmoid, "nn.silu": lambda x: x * _sigmoid(x),
    "nn.softplus": lambda x: np.maximum(x, 0.0) + np.vectorize(log1p)(np.exp(-np.abs(x))),
}


def _op(name: str):
    scope = relax.op
    for part in name.split("."):
        scope = getattr(scope, part)
    return scope


def _run(op: str, fast_math: bool) -> np.ndarray:
    import tvm

    x = tensor("x", X.shape)
    mod = make_module([x], lambda bb, x: bb.emit(_op(op)(x)))
    ex = tvm.compile(mod, target=LLVM, relax_pipeline=pipeline(LLVM, fast_math=fast_math))
    (out,) = run_cpu(ex, [X])
    return out


def _relative_error(got, want) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), 1e-3)))


@pytest.mark.parametrize("op", sorted(BOUNDS))
def test_fast_math_error_is_bounded(op):
    want = REFERENCE[op](X.astype(np.float64))
    assert _relative_error(_run(op, fast_math=True), want) <= BOUNDS[op]


@pytest.mark.parametrize("op", sorted(BOUNDS))
def test_exact_math_option_keeps_libm(op):
    want = REFERENCE[op](X.astype(np.float64))
    assert _relative_error(_run(op, fast_math=False), want) <= EXACT_BOUNDS[op]


def test_fast_math_option_is_checked():
    with pytest.raises(TypeError, match="fast_math"):
        pipeline(LLVM, fast_math="yes")


def test_fast_math_rewrites_model_activations_to_vector_code():
    """transformers' GELU arrives as one nn.gelu op: no scalar libm erf call is left in the build."""
    import tvm

    x = tensor("x", X.shape)
    mod = make_module([x], lambda bb, x: bb.emit(relax.op.nn.gelu(x)))
    ex = tvm.compile(mod, target=LLVM, relax_pipeline=pipeline(LLVM, fast_math=True))
    assert "erf" not in ex.mod.imports[0].inspect_source("ll").replace("fast_erf", "")


def test_softplus_keeps_its_threshold():
    x = tensor("x", X.shape)
    mod = make_module([x], lambda bb, x: bb.emit(relax.op.nn.softplus(x, beta=2.0, threshold=4.0)))
    import tvm

    ex = tvm.compile(mod, target=LLVM, relax_pipeline=pipeline(LLVM, fast_math=True))
    (out,) = run_cpu(ex, [X])
    x64 = X.astype(np.float64)
    want = np.where(2 * x64 > 4.0, x64, np.log1p(np.exp(2 * x64)) / 2)
    assert _relative_error(out, want) <= 1e-6
