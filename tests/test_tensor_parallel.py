"""Tensor parallelism with TVM: Disco's collectives over torch.distributed, a sharded LLaMA-style block."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402

import tvm_stitch  # noqa: E402, F401 - importing it sets tvm.runtime.disco
from tvm_stitch.tools import tensor_parallel as tp  # noqa: E402
from tvm_stitch.tools.build import build  # noqa: E402
from tvm_stitch.tools.launches import launches_by_kind  # noqa: E402


def test_importing_tvm_stitch_sets_tvm_runtime_disco():
    assert tvm.runtime.disco is not None
    assert hasattr(tvm.runtime.disco, "ProcessSession")


def test_relax_collectives_run_on_torch_distributed(one_rank):
    from tvm import relax

    from tvm_stitch.torch.disco_collectives import register

    register()
    x = relax.Var("x", relax.TensorType((4, 3), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            summed = builder.emit(relax.op.ccl.allreduce(x, "sum"))
            averaged = builder.emit(relax.op.ccl.allreduce(summed, "avg"))
            gathered = builder.emit(relax.op.ccl.allgather(averaged, num_workers=1))
            out = builder.emit_output(relax.op.ccl.broadcast_from_worker0(gathered))
        builder.emit_func_output(out)
    executable = tvm.compile(builder.get(), target="llvm")
    value = np.arange(12, dtype="float32").reshape(4, 3)
    result = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(value)).numpy()
    np.testing.assert_array_equal(result, value)


def test_tensor_parallel_shard_stitches_each_all_reduced_residual_add_into_its_rmsnorm():
    """Per shard of 2, for CUDA: TVM's default launches 10 memory-intensive kernels; the stitch pipeline 3,
    one per RMSNorm, so the residual add after each all-reduce is inside the next RMSNorm's kernel."""
    module = tp.shard_module(tp.BlockSize(), world=2)
    counts = {}
    for stitched in (False, True):
        built = build(module, {"kind": "cuda", "arch": "sm_90"}, stitched=stitched)
        counts[stitched] = launches_by_kind(built.lowered, built.executable)
        assert built.lowered["main"].script().count("runtime.disco.allreduce") == 2
    assert counts[True][0] == 3 < counts[False][0]
    assert sum(counts[True]) < sum(counts[False])


@pytest.mark.slow
def test_tensor_parallel_block_in_two_processes_equals_the_unsharded_block():
    size = tp.BlockSize()
    expected = tp.reference(tp.weights(size), size)
    for outputs in tp.launch(size, world=2):
        for out, ref in zip(outputs, expected):
            assert np.abs(out - ref).max() < 1e-5
