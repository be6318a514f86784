"""Fast math on the CPU: vectorisable exp, erf and tanh, with their error measured against numpy."""

from math import erf

import numpy as np
import pytest
from tvm import relax

from tvm_stitch.tools.build import run_cpu
from tvm_stitch.pipeline import pipeline

from conftest import LLVM, make_module, tensor

# Largest relative error (|got - want| / max(|want|, 1e-3)) allowed on [-10, 10]. Measured on this
# project's machines (README): exp 5.6e-7, erf 3.2e-7, tanh 2.8e-7 with fast math; without it,
# libm's exp and erf 6e-8, and TVM's own tanh lowering 2.9e-6.
BOUNDS = {"exp": 1e-6, "erf": 1e-6, "tanh": 1e-6}
EXACT_BOUNDS = {"exp": 1e-7, "erf": 1e-7, "tanh": 5e-6}
X = np.linspace(-10.0, 10.0, 20001, dtype=np.float32)
REFERENCE = {"exp": np.exp, "erf": np.vectorize(erf), "tanh": np.tanh}


def _run(op: str, fast_math: bool) -> np.ndarray:
    import tvm

    x = tensor("x", X.shape)
    mod = make_module([x], lambda bb, x: bb.emit(getattr(relax.op, op)(x)))
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
