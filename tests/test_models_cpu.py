"""Real models on this machine's CPU (skipped without the torch extra): the stitch pipeline schedules
every matmul and the stride-1 convolutions (schedules/cpu/contraction.py; ConvNeXt's stride-4 stem
is a matmul, rewrites/patchify.py) and the outputs match PyTorch eager."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm import tirx  # noqa: E402

from tvm_stitch.target import host_target  # noqa: E402
from tvm_stitch.tools.build import build, run_cpu  # noqa: E402
from tvm_stitch.tools.models import import_model  # noqa: E402


@pytest.mark.parametrize("name", ["bert", "llama", "convnext"])
def test_compute_intensive_ops_are_scheduled_and_outputs_match(name):
    mod, inputs, expected = import_model(name, "test")
    built = build(mod, host_target(), stitched=True)
    funcs = [(gv.name_hint, f) for gv, f in built.lowered.functions_items() if isinstance(f, tirx.PrimFunc)]
    matmuls = [(n, f) for n, f in funcs if "matmul" in n]
    convs = [(n, f) for n, f in funcs if "conv" in n]
    assert matmuls
    for fname, func in matmuls:
        assert "T.parallel(" in func.script(), fname
    if convs:
        assert any("T.parallel(" in f.script() for _, f in convs)
    outs = run_cpu(built.executable, inputs)
    for out, want in zip(outs, expected):
        np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)
