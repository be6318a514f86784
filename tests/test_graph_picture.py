"""explain on suite graphs, models and scripts; the DOT picture of the grouped graph."""

import re
import shutil

import pytest
from tvm import relax

from tvm_stitch.tools.cli import main
from tvm_stitch.explain import explain_with_graph
from tvm_stitch.tools.graph_picture import FALLBACK, to_dot
from tvm_stitch.tools.sources import SourceError, load_module

from conftest import CUDA, make_module, tensor

SCRIPT = '''
from tvm import relax

x = relax.Var("x", relax.TensorType((64, 256), "float32"))
bb = relax.BlockBuilder()
with bb.function("main", [x]):
    with bb.dataflow():
        e = bb.emit(relax.op.exp(x))
        s = bb.emit(relax.op.sum(e, axis=[1], keepdims=True))
        out = bb.emit_output(relax.op.divide(e, s))
    bb.emit_func_output(out)
mod = bb.get()
'''

_NODE = re.compile(r'^\s*"([^"]+)" \[(.*)\];$')
_EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)";$')


def _parse(dot: str):
    """(nodes: name -> attribute text, edges, clusters: name -> member names); asserts the DOT is well formed."""
    lines = dot.strip().splitlines()
    assert lines[0] == "digraph stitched {" and lines[-1] == "}"
    nodes, edges, clusters, current, depth = {}, [], {}, None, 0
    for line in lines:
        depth += line.count("{") - line.count("}")
        assert depth >= 0
        if m := re.match(r'^\s*subgraph "(cluster_[^"]+)" \{$', line):
            current = m.group(1)
            clusters[current] = []
        elif line.strip() == "}":
            current = None
        elif m := _NODE.match(line):
            nodes[m.group(1)] = m.group(2)
            if current:
                clusters[current].append(m.group(1))
        elif m := _EDGE.match(line):
            edges.append(m.groups())
        else:
            assert re.match(r"^\s*(digraph|rankdir|node |label=)", line), line
    assert depth == 0
    assert all(a in nodes and b in nodes for a, b in edges)
    return nodes, edges, clusters


def _two_groups():
    """A softmax and, across a matmul (left to TVM), a LayerNorm-like chain: two stitched groups."""
    def body(bb, x, w):
        e = bb.emit(relax.op.exp(x))
        p = bb.emit(relax.op.divide(e, bb.emit(relax.op.sum(e, axis=[1], keepdims=True))))
        y = bb.emit(relax.op.matmul(p, w))
        c = bb.emit(relax.op.subtract(y, bb.emit(relax.op.mean(y, axis=[1], keepdims=True))))
        return relax.op.multiply(c, relax.op.rsqrt(relax.op.mean(relax.op.multiply(c, c), axis=[1], keepdims=True)))

    return make_module([tensor("x", (64, 128)), tensor("w", (128, 128))], body)


def test_dot_is_well_formed_and_colours_each_stitched_group():
    report, grouped = explain_with_graph(_two_groups(), CUDA)
    nodes, edges, clusters = _parse(to_dot(grouped, report, title="two groups"))
    stitched = [g for g in report.groups if g.stitched]
    assert len(stitched) >= 2
    colours = set()
    for group in stitched:
        (cluster,) = [c for c, members in clusters.items()
                      if {f"{group.function}__{b}_{p}" for b, p in group.positions} == set(members)]
        fills = {re.search(r'fillcolor="([^"]+)"', nodes[m]).group(1) for m in clusters[cluster]}
        assert len(fills) == 1 and FALLBACK not in fills
        colours |= fills
    assert len(colours) == len(stitched)  # one colour per kernel
    outside = [n for n in nodes if not any(n in members for members in clusters.values())]
    assert any("matmul" in nodes[n] for n in outside)  # compute-intensive: white, outside the groups
    assert ("main__param_x", next(n for n in nodes if "exp" in nodes[n])) in edges
    bindings = sum(len(block.bindings) for block in grouped["main"].body.blocks)
    assert sum("shape=box" in attrs for attrs in nodes.values()) == bindings  # repeated names stay apart


def test_explain_a_script_with_a_dot_picture(tmp_path, capsys):
    script = tmp_path / "softmax.py"
    script.write_text(SCRIPT)
    dot = tmp_path / "softmax.dot"
    assert main(["explain", str(script), "--target", "llvm", "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    assert f"script {script}" in out and "row-resident" in out
    nodes, _, clusters = _parse(dot.read_text())
    assert len(clusters) == 1 and len(next(iter(clusters.values()))) == 3
    if shutil.which("dot") is None:
        assert "dot` is not installed" in out
    else:
        assert (tmp_path / "softmax.dot.svg").exists()


def test_a_script_may_define_module_instead_of_mod(tmp_path):
    script = tmp_path / "f.py"
    script.write_text(SCRIPT.replace("mod = bb.get()", "def module():\n    return bb.get()\n"))
    mod, description = load_module(str(script))
    assert "main" in [gv.name_hint for gv in mod.get_global_vars()] and description == f"script {script}"


@pytest.mark.parametrize("text, message", [
    ("x = 1\n", "defines neither a function module() nor a variable mod"),
    ("mod = 3\n", "mod is a int, not a tvm.IRModule"),
    ("raise ValueError('broken')\n", "failed to run: ValueError: broken"),
])
def test_bad_scripts_get_clear_errors(tmp_path, capsys, text, message):
    script = tmp_path / "bad.py"
    script.write_text(text)
    with pytest.raises(SourceError, match=re.escape(message)):
        load_module(str(script))
    assert main(["explain", str(script)]) == 2
    assert message in capsys.readouterr().err


def test_unknown_names_and_missing_files_get_clear_errors(capsys):
    assert main(["explain", "no_such_graph"]) == 2
    err = capsys.readouterr().err
    assert "unknown graph, model or script 'no_such_graph'" in err and "gpt2" in err and "layernorm" in err
    assert main(["explain", "/no/such/file.py"]) == 2
    assert "no such file: /no/such/file.py" in capsys.readouterr().err
    assert main(["explain", "gpt2:sideways"]) == 2
    assert "unknown step 'sideways'" in capsys.readouterr().err


def test_explain_a_model_training_step(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert main(["explain", "llama:adam", "--size", "test", "--target", "llvm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model llama adam") and "stitched kernels, 0 fallbacks" in out
