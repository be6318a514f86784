"""What an FX node is, as messages name it: its op, and the module of the model it came from."""

from __future__ import annotations

import re

NO_MODULE = "a graph that records no module"  # a backward of compiled autograd, a compiled function


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
