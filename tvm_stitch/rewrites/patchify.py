"""A patchifying convolution (stride equal to its kernel, no padding) as a matmul, on the CPU.

Vision models start with one (ViT's and Swin's patch embedding, ConvNeXt's
4 x 4 stem): every input pixel is read by exactly one output, so the
convolution is a matmul of the image cut into patches. This pass, before
LegalizeOps, rewrites such an `nn.conv2d` (NCHW data, OIHW kernel, NCHW
output, groups 1, dilation 1, static sizes that the kernel divides) as

    x (N, C, H, W) -> reshape (N, C, H/kh, kh, W/kw, kw)
                   -> permute (N, H/kh, W/kw, C, kh, kw) -> reshape (N Ho Wo, C kh kw)
    w (F, C, kh, kw) -> reshape (F, C kh kw) -> permute (C kh kw, F)
    matmul -> reshape (N, Ho, Wo, F) -> permute (N, F, Ho, Wo)

The matmul gets the register-blocked CPU schedule (schedules/cpu/contraction.py),
which declines the strided convolution (its input gathered along the output
columns), and the copies stitch with their neighbours (the model's own
permute to channels-last cancels the last one inside a stitched kernel).
The products and their order of summation per output are the convolution's.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax import Call, Expr, PyExprMutator, expr_functor

from tvm_stitch.rewrites.rebind import each_function


def _static(shape) -> list | None:
    values = list(shape.values) if isinstance(shape, relax.ShapeExpr) else None
    if values is None or not all(isinstance(v, tirx.IntImm) for v in values):
        return None
    return [int(v.value) for v in values]


def patch_sizes(call: Call) -> tuple | None:
    """(N, C, H, W, F, kh, kw) of a conv2d this pass rewrites, else None."""
    attrs = call.attrs
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv2d"):
        return None
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout or "NCHW") != ("NCHW", "OIHW", "NCHW"):
        return None
    x_ty, w_ty = call.args[0].ty, call.args[1].ty
    if not (isinstance(x_ty, relax.TensorType) and isinstance(w_ty, relax.TensorType)):
        return None
    x_shape, w_shape = _static(x_ty.shape), _static(w_ty.shape)
    if x_shape is None or w_shape is None or len(x_shape) != 4 or x_ty.dtype != w_ty.dtype:
        return None
    if attrs.out_dtype and str(attrs.out_dtype) not in ("", str(x_ty.dtype)):
        return None
    n, c, h, w = x_shape
    f, ci, kh, kw = w_shape
    strides, padding, dilation = ([int(v) for v in getattr(attrs, a)] for a in ("strides", "padding", "dilation"))
    if int(attrs.groups) != 1 or ci != c or strides != [kh, kw] or any(padding) or dilation != [1, 1]:
        return None
    if kh * kw == 1 or h % kh or w % kw:
        return None
    return n, c, h, w, f, kh, kw


@expr_functor.mutator
class _PatchifyRewriter(PyExprMutator):
    def visit_call_(self, call: Call) -> Expr:
        call = super().visit_call_(call)
        sizes = patch_sizes(call)
        if sizes is None:
            return call
        n, c, h, w, f, kh, kw = sizes
        emit, op = self.builder_.emit, relax.op
        patches = emit(op.reshape(call.args[0], (n, c, h // kh, kh, w // kw, kw)))
        patches = emit(op.permute_dims(patches, [0, 2, 4, 1, 3, 5]))
        patches = emit(op.reshape(patches, (n * (h // kh) * (w // kw), c * kh * kw)))
        weights = emit(op.permute_dims(emit(op.reshape(call.args[1], (f, c * kh * kw))), [1, 0]))
        out = emit(op.reshape(emit(op.matmul(patches, weights)), (n, h // kh, w // kw, f)))
        return op.permute_dims(out, [0, 3, 1, 2])


@tvm.transform.module_pass(opt_level=0, name="PatchifyAsMatmul")
class PatchifyAsMatmul:
    """Every patchifying conv2d of the module's Relax functions as a matmul (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return each_function(_PatchifyRewriter(mod), mod)
