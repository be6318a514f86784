"""A built graph as aot_autograd calls it: a boxed function of its inputs, tensors crossing by DLPack.

Inputs are handed to the VM without a copy (`tvm.runtime.from_dlpack` of
the tensor, detached; a non-contiguous one is made contiguous first, the
only copy), outputs come back the same way (`torch.from_dlpack`).
Placeholders that the graph returns are returned as they are, sizes it
returns are evaluated from the call's shapes.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_stitch.torch import symbols


class BuiltGraph:
    """`(args: list) -> list` with aot_autograd's boxed calling convention (it empties `args`)."""

    def __init__(self, executable, device, imported):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class's
        self.main = relax.VirtualMachine(executable, device)["main"] if imported.mod is not None else None
        self.imported = imported
        self.sizes_needed = any(o.kind == "size" and not isinstance(o.value, int) for o in imported.outputs)

    def __call__(self, args: list) -> list:
        import torch

        imported = self.imported
        outputs = []
        if self.main is not None:
            tensors = [_to_tvm(args[i]) for i in imported.tensor_inputs]
            outputs = [torch.from_dlpack(t) for t in _flatten(self.main(*tensors))]
        sizes = _sizes(imported.binders, args) if self.sizes_needed else {}
        result = [_output(o, args, outputs, sizes) for o in imported.outputs]
        args.clear()
        return result


def _to_tvm(tensor):
    tensor = tensor.detach()
    return tvm.runtime.from_dlpack(tensor if tensor.is_contiguous() else tensor.contiguous())


def _flatten(result) -> list:
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [a for r in result for a in _flatten(r)]
    return [result]


def _sizes(binders: dict, args: list) -> dict:
    return {name: int(args[i] if dim is None else args[i].shape[dim]) for name, (i, dim) in binders.items()}


def _output(output, args, outputs, sizes):
    if output.kind == "tensor":
        return outputs[output.value]
    if output.kind == "input":
        return args[output.value]
    if output.kind == "size":
        return symbols.evaluate(output.value, sizes)
    return output.value
