"""The tvm-stitch command."""

import importlib.util
import json
import re

import pytest

from tvm_stitch.tools.cli import main


def test_bench_prints_the_table_and_writes_results(capsys, tmp_path):
    assert main(["bench", "--size", "test", "--graphs", "layernorm,softmax", "--dtype", "float32,float16",
                 "--results", str(tmp_path), "--machine", "here"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "CUDA launches (default -> stitched)" in out
    assert "stitched correct" in out and "of copy BW" in out and "numpy ms" in out
    assert "| layernorm " in out and "| softmax " in out
    assert "geomean speedup" in out and "copy bandwidth" in out
    assert captured.err.count("] layernorm (") == 2, "a progress line per graph and dtype"
    written = sorted(p.name for p in (tmp_path / "here").iterdir())
    stems = {name.split(".")[0].removesuffix("-graphs") for name in written}
    assert len(stems) == 1 and {s + ".json" for s in stems} <= set(written)
    date = stems.pop()
    rows = json.loads((tmp_path / "here" / f"{date}.json").read_text())["rows"]
    assert [r["graph"] for r in rows] == ["layernorm", "softmax"] * 2
    assert all(0 < r["copy_fraction"] and r["io_bytes"] > 0 for r in rows)
    assert "| softmax " in (tmp_path / "here" / f"{date}.md").read_text()
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert (f"{date}-graphs.png" in written) == has_plot
    if not has_plot:
        assert "no PNG plots" in captured.err


def test_bench_rejects_unknown_graphs(capsys):
    assert main(["bench", "--graphs", "nope"]) == 2
    assert "unknown graph" in capsys.readouterr().err


def test_explain_prints_plans(capsys):
    """The decomposed LayerNorm at the test size (64 rows of 96) is one row-resident CUDA kernel: a block
    of 128 threads per row, both means kept in shared memory, the cheap element-wise ops in registers."""
    assert main(["explain", "layernorm", "--size", "test"]) == 0
    out = capsys.readouterr().out
    row = _plan_row(out)
    kernel, _ops, scheme, dominant, mapping, reuse, _mb, modeled = row
    assert re.fullmatch(r"\d+\.\d+ us \(\d+%\)", modeled), modeled  # the time model's price, CUDA
    assert re.fullmatch(r"stitch_0_mean_\w+", kernel), kernel
    assert (scheme, dominant, mapping) == ("row-resident", "x_red,x_red1", "64 blocks x 128 thr, 1 row/blk")
    assert "1 stitched kernels, 0 fallbacks" in out
    assert f"{kernel}: row-resident, rows ('64',)" in out and "inputs loaded once into shared memory: x" in out
    levels = dict(re.findall(r"^  (\w+) {2,}(register|shared|global) ", out, re.M))
    assert {name for name, level in levels.items() if level == "shared"} == {"x_red", "x_red1", "T_divide"}
    assert {levels[name] for name in ("T_subtract", "T_multiply", "T_add", "compute")} == {"register"}
    counts = [sum(level == kind for level in levels.values()) for kind in ("register", "shared", "global")]
    assert reuse == "/".join(map(str, counts)) == "7/3/0"


def _plan_row(out: str) -> list[str]:
    """The columns of the plan table's first row: the line under the header that starts with 'kernel  ops'
    (the per-kernel bound tables that follow have other headers)."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"kernel\s{2,}ops\s{2,}scheme", line))
    return re.split(r"\s{2,}", lines[header + 2].strip())


def _one_line_exit_2(capsys, argv) -> str:
    """Run the command; it must exit 2 with one line on stderr and nothing on stdout. The line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_explain_of_a_script_that_raises_is_one_line(capsys, tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("raise RuntimeError('boom')\n")
    line = _one_line_exit_2(capsys, ["explain", str(script)])
    assert "RuntimeError: boom" in line and str(script) in line


def test_explain_of_a_script_whose_module_raises_is_one_line(capsys, tmp_path):
    script = tmp_path / "module_raises.py"
    script.write_text("def module():\n    return {}['missing']\n")
    line = _one_line_exit_2(capsys, ["explain", str(script)])
    assert "module() failed: KeyError" in line


def test_explain_of_a_script_that_exits_is_one_line(capsys, tmp_path):
    """sys.exit(7) in the script used to end tvm-stitch with status 7 and no message."""
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(7)\n")
    line = _one_line_exit_2(capsys, ["explain", str(script)])
    assert "sys.exit(7)" in line


def test_explain_names_a_bad_arch_with_the_known_ones(capsys):
    line = _one_line_exit_2(capsys, ["explain", "softmax", "--size", "test", "--arch", "foo"])
    assert "'foo'" in line and "sm_80" in line and "sm_90" in line


def test_explain_checks_the_dot_path_before_the_work(capsys, monkeypatch):
    import tvm_stitch.tools.sources as sources

    def no_work(*_args, **_kwargs):
        raise AssertionError("the graph was loaded before --dot was checked")

    monkeypatch.setattr(sources, "load_module", no_work)
    line = _one_line_exit_2(capsys, ["explain", "softmax", "--size", "test", "--dot", "/proc/nope/x.dot"])
    assert "--dot /proc/nope/x.dot" in line


def test_explain_refuses_a_folder_as_the_dot_file(capsys, tmp_path):
    line = _one_line_exit_2(capsys, ["explain", "softmax", "--size", "test", "--dot", str(tmp_path)])
    assert "is a folder" in line


def test_evaluate_without_held_out_records_is_one_line(capsys, tmp_path):
    line = _one_line_exit_2(capsys, ["evaluate", "--held-out", str(tmp_path / "missing"), "--out", str(tmp_path),
                                     "--no-compile", "--no-bench"])
    assert "missing" in line


def test_gpu_kit_names_an_unknown_graph_and_builds_nothing(capsys, tmp_path):
    out = tmp_path / "kit"
    line = _one_line_exit_2(capsys, ["gpu-kit", "--graphs", "nosuch", "--no-wheel", "--out", str(out)])
    assert "nosuch" in line and "layernorm" in line
    assert not out.exists()


def test_train_names_a_file_that_is_not_records(capsys, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text("not json\n")
    line = _one_line_exit_2(capsys, ["train", "--records", str(records), "--out", str(tmp_path / "m.json")])
    assert "line 1" in line and str(records) in line


def test_counts_below_their_least_are_one_line(capsys):
    assert "--nvcc-every" in _one_line_exit_2(capsys, ["fuzz", "--n", "1", "--nvcc-every", "-1"])
    assert "--rounds" in _one_line_exit_2(capsys, ["torch-compile", "--rounds", "0"])
    assert "--size" in _one_line_exit_2(capsys, ["torch-compile", "--size", "huge"])


def test_output_paths_are_checked_before_the_work(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "--json" in _one_line_exit_2(capsys, ["bench", "--json", str(blocker / "x.json")])
    assert "--results" in _one_line_exit_2(capsys, ["bench", "--results", str(blocker)])
    assert "--save" in _one_line_exit_2(capsys, ["fuzz", "--save", str(blocker / "saved")])
    assert "--records" in _one_line_exit_2(capsys, ["tune", "--shapes", "train", "--records",
                                                    str(blocker / "r.jsonl")])
    assert "--out" in _one_line_exit_2(capsys, ["evaluate", "--out", str(blocker)])
    assert list(tmp_path.iterdir()) == [blocker]


@pytest.mark.parametrize("argv, message", [
    (["explain", "softmax", "--target", "foo"], "invalid choice: 'foo'"),
    (["fuzz", "--n", "x"], "invalid int value: 'x'"),
    (["explain", "softmax", "--dtype", "int8"], "'int8'"),
    ([], "required: command"),
])
def test_argument_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_simt_names_a_malformed_arch(capsys):
    assert "'sm_x'" in _one_line_exit_2(capsys, ["simt", "softmax", "--arch", "sm_x"])


def test_an_internal_error_keeps_its_traceback(monkeypatch, tmp_path):
    """Only a user's mistake is one line: a bug in tvm-stitch (here a KeyError) propagates."""
    import tvm_stitch.tools.evaluate as evaluate

    def broken(*_args, **_kwargs):
        raise KeyError("internal")

    monkeypatch.setattr(evaluate, "evaluate", broken)
    with pytest.raises(KeyError, match="internal"):
        main(["evaluate", "--out", str(tmp_path)])


def test_explain_says_an_element_wise_kernel_runs_an_element_per_thread(capsys, tmp_path):
    """add + relu on 64x256: the kernel binds 64 blocks of 256 threads, an element each (the
    mapping column said '1 thr, 256 row/blk')."""
    import runpy

    import tvm
    import tvm_ffi

    import tvm_stitch

    script = tmp_path / "add_relu.py"
    script.write_text(ADD_RELU)
    assert main(["explain", str(script), "--fusion", "greedy"]) == 0
    out = capsys.readouterr().out
    row = _plan_row(out)
    assert row[4] == "64 blocks x 256 thr, 1 elem/thr"
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        built = tvm_stitch.pipeline(target, fusion="greedy")(runpy.run_path(str(script))["mod"])
    (kernel,) = [f for gv, f in built.functions_items() if gv.name_hint.startswith("stitch_")]
    bindings = {}

    def on_for(loop):
        if loop.thread_binding is not None:
            bindings[str(loop.thread_binding.thread_tag)] = int(loop.extent)

    tvm_ffi.structural_walk(kernel.body, (tvm.tirx.For, on_for), order="pre")
    assert bindings == {"blockIdx.x": 64, "threadIdx.x": 256}


ADD_RELU = '''
from tvm.script import ir as I, relax as R


@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((64, 256), "float32"), y: R.Tensor((64, 256), "float32")):
        with R.dataflow():
            a = R.add(x, y)
            b = R.nn.relu(a)
            R.output(b)
        return b


mod = Module
'''
