"""How close a stitched result must be to its reference: one table for bench, fuzz, tune and the GPU kit.

`TOLERANCE[dtype] = (rtol, atol)`: an element passes when
`|got - want| <= atol + rtol * |want|` (numpy's `allclose`). The GPU kit
ships this file beside `run_kit.py` (it imports nothing else of ours).
"""

TOLERANCE = {"float32": (2e-4, 2e-4), "float16": (3e-2, 3e-2), "bfloat16": (6e-2, 6e-2)}


def tolerance(dtype: str) -> tuple:
    """(rtol, atol) for `dtype`; float32's for any dtype the table does not name."""
    return TOLERANCE.get(str(dtype), TOLERANCE["float32"])
