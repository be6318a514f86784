"""The tvm-stitch command."""

import importlib.util
import json
import re

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
    (row,) = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
              if line.startswith("stitch_") and ": " not in line]
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
