"""Real models imported from PyTorch (skipped without the torch extra)."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_stitch.tools.build import build, run_cpu  # noqa: E402
from tvm_stitch.tools.launches import launches_by_kind  # noqa: E402
from tvm_stitch.tools.models import import_model  # noqa: E402


@pytest.mark.parametrize("name, size", [("gpt2", "bench"), ("llama", "bench"), ("convnext", "test")])
def test_model_forward_is_correct_with_fewer_memory_intensive_launches(name, size):
    mod, inputs, expected = import_model(name, size)
    cpu = build(mod, {"kind": "llvm"}, stitched=True)
    (out,) = run_cpu(cpu.executable, inputs)
    np.testing.assert_allclose(out, expected[0], rtol=1e-3, atol=1e-3)
    counts = {}
    for stitched in (False, True):
        built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=stitched)
        counts[stitched] = launches_by_kind(built.lowered, built.executable)
    assert counts[True][0] < counts[False][0]
    assert counts[True][1] == counts[False][1]  # matmuls keep TVM's default handling


def test_unknown_models_and_sizes_are_refused():
    from tvm_stitch.tools.models import make_model

    with pytest.raises(KeyError, match="unknown model 'resnet'"):
        make_model("resnet")
    with pytest.raises(ValueError, match="size must be one of"):
        make_model("gpt2", "huge")
