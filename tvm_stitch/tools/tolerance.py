"""How close a stitched result must be to its reference: one table for bench, fuzz, tune and the GPU kit.

`TOLERANCE[dtype] = (rtol, atol)`: an element passes when
`|got - want| <= atol + rtol * |want|` (numpy's `allclose`); `close` also
asks for equal NaN and infinity patterns, and for integers and bools,
equal values. The GPU kit
ships this file beside `run_kit.py` (it imports nothing else of ours).
"""

TOLERANCE = {"float32": (2e-4, 2e-4), "float16": (3e-2, 3e-2), "bfloat16": (6e-2, 6e-2)}


def tolerance(dtype: str) -> tuple:
    """(rtol, atol) for `dtype`; float32's for any dtype the table does not name."""
    return TOLERANCE.get(str(dtype), TOLERANCE["float32"])


def close(got, want, dtype: str) -> bool:
    """`got` matches `want` (arrays of `dtype`): same shape, NaN and infinity patterns; finite floats
    within `tolerance(dtype)`, other dtypes equal."""
    import numpy as np

    if got.shape != want.shape:
        return False
    if str(dtype) not in TOLERANCE:
        return bool(np.array_equal(got, want))
    a, b = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    infinite = np.isinf(a) | np.isinf(b)
    if not np.array_equal(a[infinite], b[infinite]):
        return False
    finite = np.isfinite(a) & np.isfinite(b)
    rtol, atol = tolerance(dtype)
    return bool(np.all(np.abs(a[finite] - b[finite]) <= atol + rtol * np.abs(b[finite])))
