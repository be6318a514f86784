"""Independent stitching packs one kernel applied to several tensors, and kernels of several shapes."""

import numpy as np
import pytest

from tvm_stitch.tools.build import build, cuda_launches, run_cpu
from tvm_stitch.tools.workloads import SUITE, dims, reference
from tvm_stitch.tools.tolerance import tolerance

from conftest import LLVM, NVCC, nvcc


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


def _two_symbolic_maps():
    from tvm import relax, tirx

    from conftest import make_module, tensor

    s = tirx.Var("s", "int64")

    def body(bb, x, y):
        return relax.Tuple([bb.emit(relax.op.exp(x)), bb.emit(relax.op.add(relax.op.multiply(y, relax.const(2.0)),
                                                                            relax.const(1.0)))])

    return make_module([tensor("x", [2, s]), tensor("y", [3, s, 4])], body)


def test_independent_kernels_of_a_symbolic_size_share_a_launch(rng, tmp_path):
    # Task ranges of symbolic length: the second member's tasks start at the first's runtime count.
    from tvm_stitch.tools.launches import count_launches, cuda_source

    mod = _two_symbolic_maps()
    cuda = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True)
    assert cuda.report.packs and count_launches(cuda.lowered, cuda.executable) == 1
    if NVCC is not None:
        nvcc(cuda_source(cuda.executable), tmp_path)
    for emulate in (None, "cuda"):
        cpu = build(mod, LLVM, stitched=True, emulate=emulate)
        for length in (1, 7, 300):
            x = rng.standard_normal((2, length)).astype("float32")
            y = rng.standard_normal((3, length, 4)).astype("float32")
            a, b = run_cpu(cpu.executable, [x, y])
            np.testing.assert_allclose(a, np.exp(x), rtol=1e-5)
            np.testing.assert_allclose(b, y * 2 + 1, rtol=1e-6)


def test_the_simt_checker_runs_a_packed_kernel_of_a_symbolic_size_at_each_size():
    # Its task counts are scalar parameters: one symbolic build, launched with them at every size.
    import tvm_stitch.simt
    from tvm_stitch.simt.opencl_run import NoOpenclDevice, device_for

    try:
        device_for(False)
    except NoOpenclDevice as err:
        pytest.skip(str(err))
    report = tvm_stitch.simt.check(_two_symbolic_maps(), sizes={"s": [1, 7, 300]})
    assert [k.name for k in report.kernels] == [packed for packed, _ in report.stitch.packs], str(report)
    assert report.ok and report.kernels[0].sizes == ("s=1", "s=7", "s=300"), str(report)
