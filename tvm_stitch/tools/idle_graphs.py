"""Graphs whose resident-row plans leave the GPU under-filled: a GroupNorm through a reshape, a mean over
a middle axis with the subtract and exp after it, a normalisation over a middle axis after a reshape, a
LayerNorm backward of few rows (Relax modules)."""

from __future__ import annotations

from tvm import relax

from tvm_stitch.tools.workloads import SUITE, dims
from tvm_stitch.tools.workloads import relax_blocks as rx

op = relax.op


def group_norm(shape=(8, 32, 64, 64), groups: int = 8, dtype: str = "float32"):
    """(N, C, H, W) reshaped to (N, groups, C/groups*H*W), normalised per group, reshaped back."""
    n, c, h, w = shape

    def body(bb, x):
        grouped = bb.emit(op.reshape(x, (n, groups, c // groups * h * w)))
        mean = bb.emit(op.mean(grouped, axis=[2], keepdims=True))
        centred = bb.emit(op.subtract(grouped, mean))
        var = bb.emit(op.mean(op.multiply(centred, centred), axis=[2], keepdims=True))
        y = bb.emit(op.multiply(centred, op.rsqrt(op.add(var, rx.const(1e-5, dtype)))))
        return bb.emit(op.reshape(y, shape))

    return rx.function([rx.tensor("x", shape, dtype)], body)


def middle_axis_exp(shape=(64, 1024, 32), dtype: str = "float32"):
    """exp(x - mean(x, axis=1)) over (A, B, C)."""
    def body(bb, x):
        mean = bb.emit(op.mean(x, axis=[1], keepdims=True))
        return bb.emit(op.exp(op.subtract(x, mean)))

    return rx.function([rx.tensor("x", shape, dtype)], body)


def middle_axis_norm(shape=(32, 2048, 64), reshaped: bool = False, dtype: str = "float32"):
    """x (A, B, C) normalised over B (mean and variance over the middle axis); `reshaped`: x comes as
    (A, B * C), reshaped to (A, B, C) and back."""
    a, b, c = shape

    def body(bb, x):
        y = bb.emit(op.reshape(x, shape)) if reshaped else x
        mean = bb.emit(op.mean(y, axis=[1], keepdims=True))
        centred = bb.emit(op.subtract(y, mean))
        var = bb.emit(op.mean(op.multiply(centred, centred), axis=[1], keepdims=True))
        normed = bb.emit(op.multiply(centred, op.rsqrt(op.add(var, rx.const(1e-5, dtype)))))
        return bb.emit(op.reshape(normed, (a, b * c))) if reshaped else normed

    return rx.function([rx.tensor("x", (a, b * c) if reshaped else shape, dtype)], body)


def layernorm_backward(rows: int = 2048, cols: int = 768, dtype: str = "float32"):
    """The suite's LayerNorm backward (dx, dgamma, dbeta) at rows x cols."""
    return SUITE["layernorm_backward"].build(dtype, dict(dims("bench"), rows=rows, cols=cols))


# name -> a Relax module at the size the guard is checked at
GRAPHS = {
    "group_norm_8x32x64x64_g8": group_norm,
    "group_norm_2x64x128x128_g32": lambda: group_norm((2, 64, 128, 128), 32),
    "middle_axis_exp_64x1024x32": middle_axis_exp,
    "middle_axis_exp_64x512x64": lambda: middle_axis_exp((64, 512, 64)),
    "middle_axis_norm_32x2048x64": middle_axis_norm,
    "middle_axis_norm_reshaped_32x2048x64": lambda: middle_axis_norm(reshaped=True),
    "layernorm_backward_2048x768": layernorm_backward,
}
