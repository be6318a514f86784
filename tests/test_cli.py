"""The tvm-stitch command."""

from tvm_stitch.cli import main


def test_bench_prints_the_table(capsys):
    assert main(["bench", "--size", "test", "--graphs", "layernorm,softmax", "--dtype", "float32,float16"]) == 0
    out = capsys.readouterr().out
    assert "CUDA launches (default -> stitched)" in out
    assert "stitched correct" in out
    assert "| layernorm " in out and "| softmax " in out
    assert "geomean speedup" in out


def test_bench_rejects_unknown_graphs(capsys):
    assert main(["bench", "--graphs", "nope"]) == 2
    assert "unknown graph" in capsys.readouterr().err


def test_explain_prints_plans(capsys):
    assert main(["explain", "layernorm", "--size", "test"]) == 0
    out = capsys.readouterr().out
    assert "row-resident" in out and "register" in out
