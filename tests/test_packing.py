"""Independent stitching packs one kernel applied to several tensors, and kernels of several shapes."""

import numpy as np
import pytest

from tvm_stitch.tools.build import build, cuda_launches, run_cpu
from tvm_stitch.tools.suite import SUITE, dims, reference
from tvm_stitch.tools.tolerance import tolerance

from conftest import LLVM


def _repeats(report) -> bool:
    return any(len(set(members)) < len(members) for _, members in report.packs)


def test_adam_over_six_shapes_twice_is_one_cuda_launch_with_repeated_members():
    # 12 tensors, 6 shapes: each shape's update kernel is packed twice, beside the other shapes'.
    mod = SUITE["adam_update"].build("float32", dims("test"))
    built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert _repeats(built.report)
    assert cuda_launches(mod, stitched=True) <= 2 < cuda_launches(mod, stitched=False)


@pytest.mark.parametrize("emulate", [None, "cuda"])
def test_packs_with_repeated_members_match_numpy_on_the_cpu(emulate, rng):
    graph = SUITE["adam_update"]
    inputs = graph.inputs(rng, "float32", dims("test"))
    built = build(graph.build("float32", dims("test")), LLVM, stitched=True, emulate=emulate)
    assert _repeats(built.report)
    rtol, atol = tolerance("float32")
    for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, inputs)):
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)
