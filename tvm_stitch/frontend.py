"""from_torch: a PyTorch module into a Relax IRModule, through torch.export and TVM's importer.

The model is exported as the user calls it (`args`, `kwargs`, optional
`dynamic_shapes`) and imported with TVM 0.27's
`from_exported_program`, with the traps that transformers models meet
there handled where they arise:

- the KV cache: decoders start each layer's cache as `torch.tensor([])`
  and concatenate onto it, which the importer cannot type; export runs
  with `config.use_cache = False` (a warning says so);
- scaled-dot-product attention: PyTorch's own decomposition of it fails on
  some models (GPT-2), and TVM's converter takes only float masks; a
  transformers model is exported with eager attention (a warning says
  so), and `aten.scaled_dot_product_attention` is never decomposed;
- `cumsum` of a bool tensor (the packed-sequence check of transformers'
  masks): the importer keeps it bool and the llvm build fails; it is
  summed as int64, as in PyTorch;
- slices under symbolic shapes (BERT's position ids `[:, :s]` of a
  512-long buffer, the slices PyTorch decomposes that check's `torch.diff` into): the importer's extents
  `min(s, 512)`, `min(1, s)` defeat shape inference downstream; where
  PyTorch proved a constant or a plain symbol, the result is cast to it;
- half precision: the importer's matrix products and convolutions come out
  float32 (their half bias then fails to add, or the float32 spreads);
  torch/dtype_converters' converters keep the float32 accumulation and give each
  the dtype PyTorch gives it;
- gradients of embeddings (`index_put` accumulating over 2-d token ids)
  and of 2-d convolutions (`convolution_backward`), which the importer
  refuses or lacks: tvm_stitch.torch.gradient_ops' converters, the ones
  the torch.compile backend uses;
- `native_layer_norm`'s mean and rstd outputs, which the importer maps to
  the normalised output: refused with an error naming the node.

Anything else the importer cannot convert raises UnsupportedModelError
naming the op and the module path where the model uses it.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import tvm

from tvm_stitch.torch.exported_program import converters
from tvm_stitch.torch.nodes import module_path


class UnsupportedModelError(ValueError):
    """The model uses something TVM's importer cannot convert; the message names the op and where."""


def from_torch(model, args=(), kwargs=None, dynamic_shapes=None) -> tvm.IRModule:
    """Export `model(*args, **kwargs)` with torch.export and import it as a Relax IRModule.

    `dynamic_shapes` is torch.export's (e.g. `{"input_ids": {1: Dim("s", max=512)}}`):
    those dimensions become symbolic variables of the module. Weights are
    imported as constants. The model runs in inference mode (no gradients).
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_torch expects a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, not {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, not {type(kwargs).__name__}")
    with export_settings(model), torch.no_grad():
        program = torch.export.export(model, args, kwargs or {}, dynamic_shapes=dynamic_shapes)
        program = program.run_decompositions(_decompositions(torch))
    check_importable(program.graph)
    from tvm.relax.frontend.torch import from_exported_program

    return from_exported_program(program, keep_params_as_input=False, run_ep_decomposition=False,
                                 custom_convert_map=converters())


def _torch():
    try:
        import torch
    except ImportError as err:
        raise RuntimeError("from_torch needs PyTorch: pip install torch==2.13.0") from err
    return torch


@contextlib.contextmanager
def export_settings(model):
    """A transformers model exports without its KV cache and with eager attention; restored after."""
    config = getattr(model, "config", None)
    changed = []
    if config is not None and getattr(config, "use_cache", False):
        warnings.warn("from_torch: exporting with use_cache=False (TVM's importer cannot type the empty "
                      "KV-cache placeholders that the cache concatenates onto)", stacklevel=3)
        config.use_cache = False
        changed.append(lambda: setattr(config, "use_cache", True))
    attention = getattr(config, "_attn_implementation", None) if config is not None else None
    if attention not in (None, "eager") and hasattr(model, "set_attn_implementation"):
        warnings.warn(f"from_torch: exporting with eager attention instead of {attention!r} (PyTorch's "
                      "decomposition of scaled_dot_product_attention fails on some models, and TVM's "
                      "converter takes float masks only)", stacklevel=3)
        model.set_attn_implementation("eager")
        changed.append(lambda: model.set_attn_implementation(attention))
    try:
        yield
    finally:
        for undo in reversed(changed):
            undo()


def _decompositions(torch) -> dict:
    """torch.export's default table, without scaled_dot_product_attention (TVM converts it whole)."""
    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    return table


def check_importable(graph) -> None:
    """Raise UnsupportedModelError for ops TVM's importer lacks or gets wrong, naming each with its module."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    torch = _torch()
    known = set(ExportedProgramImporter().convert_map) | set(converters())
    missing = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name not in known:
            missing.setdefault(name, module_path(node))
        if node.target == torch.ops.aten.native_layer_norm.default:
            for user in node.users:
                if user.target == operator.getitem and user.args[1] in (1, 2) and user.users:
                    raise UnsupportedModelError(
                        f"{user.name} reads the {'mean' if user.args[1] == 1 else 'rstd'} of native_layer_norm "
                        f"in {module_path(node)}: TVM's importer maps it to the normalised output")
    if missing:
        listed = "; ".join(f"{op} in {where}" for op, where in sorted(missing.items()))
        raise UnsupportedModelError(f"TVM's importer has no converter for: {listed}")
