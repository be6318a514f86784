"""An aot_autograd ATen graph into a Relax IRModule, through TVM's exported-program importer's converters.

aot_autograd hands each compiler a functionalised ATen graph whose
placeholders are the parameters, the user's tensors and, under dynamic
shapes, the sizes (SymInts). The converters of TVM's
`ExportedProgramImporter` (keyed by ATen op name, as in a
`torch.export` program) translate its nodes; what an ExportedProgram
would give the importer is made here from the example inputs instead:

- each tensor placeholder is a parameter of `main`, its symbolic sizes
  TIR variables (symbols.to_tir), the bounds dynamo knows recorded as
  `tir_var_lower_bound` / `tir_var_upper_bound`;
- a SymInt placeholder is the TIR expression of its symbol (not a
  parameter: a tensor's shape defines it);
- outputs that are placeholders pass through, SymInt outputs are
  evaluated from the call's sizes, None stays None: only tensors computed
  by the graph are outputs of `main`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import tvm
from tvm import relax

from tvm_stitch.torch import symbols
from tvm_stitch.torch.converters import converters
from tvm_stitch.torch.errors import UnsupportedGraph


@dataclass(frozen=True)
class Output:
    """Where one graph output comes from: `kind` is "tensor" (index into main's outputs), "input"
    (a placeholder's index), "size" (a sympy expression of the sizes) or "value" (a constant)."""

    kind: str
    value: object


@dataclass
class ImportedGraph:
    mod: tvm.IRModule | None  # None when no output is computed
    tensor_inputs: list  # placeholder indices of main's parameters, in order
    outputs: list  # Output per graph output
    binders: dict = field(default_factory=dict)  # size symbol -> (input index, dim or None)


NO_MODULE = "a graph that records no module"  # a backward of compiled autograd, a compiled function
NOT_OPS = frozenset({"", "placeholder", "get_attr", "call_module", "call_method", "output"})  # no op to leave on eager


def op_name(node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def module_path(node) -> str:
    """The module a node came from, as the user names it (dynamo's `L['self']` prefix removed)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return NO_MODULE
    path, kind = list(stack.values())[-1]
    path = re.sub(r"^L\[[^\]]*\](\[\d+\])?\.?", "", path)  # dynamo's source of the module: L['self'], L['args'][0]
    kind = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
    return f"{path or 'the top module'} ({kind})"


def graph_module_path(gm) -> str:
    """The module path of a graph's first node that records one."""
    return next((module_path(n) for n in gm.graph.nodes if n.meta.get("nn_module_stack")), NO_MODULE)


def _importer():
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    importer = ExportedProgramImporter()
    importer.update_convert_map(converters())
    return importer


def unsupported_nodes(graph) -> list:
    """The call_function nodes whose op the importer has no converter for."""
    known = set(_importer().convert_map)
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) not in known]


def import_graph(gm, example_inputs) -> ImportedGraph:
    """Translate `gm` (example inputs: fake tensors, SymInts, ints) into a Relax module; UnsupportedGraph if not."""
    missing = unsupported_nodes(gm.graph)
    if missing:
        raise UnsupportedGraph(f"no converter for {op_name(missing[0])}", op_name(missing[0]), module_path(missing[0]))
    importer = _importer()
    custom = set(converters())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise UnsupportedGraph(f"{len(placeholders)} placeholders for {len(example_inputs)} inputs", "placeholder")
    variables, params, tensor_inputs = {}, [], []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        importer.env[node] = _placeholder(node, value, variables, importer)
        if isinstance(importer.env[node], relax.Expr) and isinstance(importer.env[node].ty, relax.TensorType):
            params.append(importer.env[node])
            tensor_inputs.append(index)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    importer.block_builder = relax.BlockBuilder()
    lower, upper = symbols.bounds(symbols.shape_env_of(example_inputs), list(variables))
    attrs = {**({"tir_var_lower_bound": lower} if lower else {}), **({"tir_var_upper_bound": upper} if upper else {})}
    with importer.block_builder.function("main", params=params, attrs=attrs or None):
        with importer.block_builder.dataflow():
            for node in gm.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                importer.env[node] = _convert(node, gm, importer, custom)
            outputs, computed = _outputs(output_node, placeholders, importer)
            result = importer.block_builder.emit_output(relax.Tuple(computed))
        importer.block_builder.emit_func_output(result)
    mod = relax.transform.DeadCodeElimination()(importer.block_builder.get()) if computed else None
    return ImportedGraph(mod, tensor_inputs, outputs, symbols.binders(example_inputs))


def _placeholder(node, value, variables, importer):
    import torch

    if isinstance(value, torch.Tensor):
        shape = [symbols.to_tir(symbols.expression(s), variables) for s in value.shape]
        return relax.Var(node.name, relax.TensorType(shape, importer._convert_data_type(value.dtype)))
    if symbols.is_symbolic(value) and type(value).__name__ == "SymInt":
        return symbols.to_tir(symbols.expression(value), variables)
    if isinstance(value, int):
        return value
    raise UnsupportedGraph(f"placeholder {node.name} is a {type(value).__name__}", "placeholder", node.name)


def _convert(node, gm, importer, custom):
    if node.op == "get_attr":
        tensor = getattr(gm, node.target)
        return relax.const(importer._convert_pytorch_tensor_to_tvm(tensor.detach().contiguous()))
    if node.op != "call_function":
        raise UnsupportedGraph(f"{node.op} node {node.name}", node.op, module_path(node))
    name = op_name(node)
    try:
        return importer.convert_map[name](node, importer) if name in custom else importer.convert_map[name](node)
    except UnsupportedGraph:
        raise
    except Exception as err:  # noqa: BLE001 - a converter failing on this node: the graph goes to eager
        lines = str(err).strip().splitlines()
        raise UnsupportedGraph(f"{name}: {type(err).__name__}: {lines[-1][:200] if lines else ''}",
                               name, module_path(node)) from err


def _outputs(output_node, placeholders, importer) -> tuple[list, list]:
    """(Output per graph output, main's computed tensors)."""
    import torch

    index_of = {n: i for i, n in enumerate(placeholders)}
    outputs, computed = [], []
    for arg in output_node.args[0]:
        if arg is None or not hasattr(arg, "op"):
            outputs.append(Output("value", arg))
        elif arg in index_of:
            outputs.append(Output("input", index_of[arg]))
        elif not isinstance(arg.meta.get("val"), torch.Tensor):
            outputs.append(Output("size", symbols.expression(arg.meta.get("val"))))
        else:
            expr = importer.env[arg]
            if not isinstance(expr, relax.Expr) or not isinstance(expr.ty, relax.TensorType):
                raise UnsupportedGraph(f"output {arg.name} is not a tensor in Relax", op_name(arg), module_path(arg))
            outputs.append(Output("tensor", len(computed)))
            computed.append(expr)
    return outputs, computed
