"""A Graphviz DOT picture of the graph StitchFusion grouped, stitched groups coloured.

The picture shows each Relax function of the grouped module (FuseOps'
output, the graph the stitch pass sees): one box per binding, labelled with
its variable and what it calls (a FuseOps group, a PrimFunc or a Relax op),
an edge per data dependence, graph inputs as ellipses. Bindings of one
stitched kernel share a fill colour and sit in a cluster named after the
kernel; bindings of groups that fell back are grey with a dashed border;
everything else (compute-intensive ops, TVM's default path) is white.
`TupleGetItem` bindings are folded into the binding they read.

`write_picture` writes the DOT text and, where Graphviz's `dot` binary is on
the PATH, renders it to SVG next to it.
"""

from __future__ import annotations

import shutil
import subprocess

import tvm
from tvm import relax

from tvm_stitch.report import StitchReport

PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#bc80bd", "#ccebc5", "#ffed6f", "#a6cee3")
FALLBACK = "#d9d9d9"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _callee(value) -> str:
    if isinstance(value, relax.Call):
        op = value.op
        if isinstance(op, tvm.ir.GlobalVar):
            return op.name_hint
        if isinstance(op, tvm.ir.Op):
            if op.name in ("relax.call_tir", "relax.call_tir_inplace") and isinstance(value.args[0], tvm.ir.GlobalVar):
                return value.args[0].name_hint
            return op.name.replace("relax.", "")
    return type(value).__name__


def _used_vars(expr) -> list:
    return list(relax.analysis.free_vars(expr))


def group_colours(report: StitchReport) -> dict:
    """(function, block index, binding index) -> (cluster id, label, fill colour, stitched) per grouped binding."""
    out = {}
    stitched = 0
    for index, group in enumerate(report.groups):
        if group.stitched:
            colour, label = PALETTE[stitched % len(PALETTE)], group.kernel
            stitched += 1
        else:
            colour, label = FALLBACK, "fallback: " + group.fallback[:60]
        for block, position in group.positions:
            out[(group.function, block, position)] = (f"cluster_{group.function}_{index}", label, colour,
                                                      group.stitched)
    return out


def to_dot(grouped: tvm.IRModule, report: StitchReport, title: str = "") -> str:
    """DOT text of every Relax function of `grouped`, groups of `report` coloured."""
    colours = group_colours(report)
    lines = ["digraph stitched {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
    if title:
        lines.append(f"  label={_quote(title)}; labelloc=t;")
    for gv, func in grouped.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs is not None and "Primitive" in func.attrs):
            continue  # FuseOps' groups are drawn as the bindings that call them
        fname = gv.name_hint
        ids: dict = {}  # relax.Var -> node id
        clusters: dict = {}  # cluster id -> (label, [node lines])
        loose = []
        edges = []
        for param in func.params:
            ids[param] = f"{fname}__param_{param.name}"
            loose.append(f"  {_quote(ids[param])} [label={_quote(param.name)}, shape=ellipse];")
        for block_index, block in enumerate(func.body.blocks):
            for position, binding in enumerate(block.bindings):
                value = binding.value
                if isinstance(value, relax.TupleGetItem) and value.tuple_value in ids:
                    ids[binding.var] = ids[value.tuple_value]
                    continue
                node = f"{fname}__{block_index}_{position}"
                ids[binding.var] = node
                for used in _used_vars(value):
                    if used in ids and (ids[used], node) not in edges:
                        edges.append((ids[used], node))
                label = f"{binding.var.name}\n{_callee(value)}"
                group = colours.get((fname, block_index, position))
                if group is None:
                    loose.append(f"  {_quote(node)} [label={_quote(label)}, shape=box];")
                    continue
                cluster, cluster_label, colour, stitched = group
                style = "filled" if stitched else "filled,dashed"
                clusters.setdefault(cluster, (cluster_label, colour, []))[2].append(
                    f"    {_quote(node)} [label={_quote(label)}, shape=box, style={_quote(style)}, "
                    f"fillcolor={_quote(colour)}];")
        out_node = f"{fname}__return"
        loose.append(f"  {_quote(out_node)} [label=\"output\", shape=ellipse];")
        for used in _used_vars(func.body.body):
            if used in ids:
                edges.append((ids[used], out_node))
        lines.extend(loose)
        for cluster, (label, colour, members) in clusters.items():
            lines.append(f"  subgraph {_quote(cluster)} {{")
            lines.append(f"    label={_quote(label)}; color={_quote(colour)}; penwidth=2;")
            lines.extend(members)
            lines.append("  }")
        lines.extend(f"  {_quote(a)} -> {_quote(b)};" for a, b in edges)
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_picture(dot_text: str, path: str) -> str:
    """Write the DOT text to `path`; render `path`.svg with Graphviz's `dot` if present.

    Returns a line saying what was written.
    """
    with open(path, "w", encoding="utf-8") as out:
        out.write(dot_text)
    dot = shutil.which("dot")
    if dot is None:
        return (f"wrote {path} (Graphviz's `dot` is not installed here, so no SVG: "
                f"render it with `dot -Tsvg {path} -o {path}.svg`)")
    subprocess.run([dot, "-Tsvg", path, "-o", path + ".svg"], check=True)
    return f"wrote {path} and {path}.svg"
