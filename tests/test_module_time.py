"""A whole module priced (tools/module_time.py): which kernels are stitched, which contract tensors."""

from tvm import relax

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.module_time import default_module_time, stitched_module_time

from conftest import CUDA, make_module, tensor

op = relax.op
SPEC = TargetSpec.from_target(CUDA)


def _softmax_then_matmul():
    x, w = tensor("x", (2048, 1024)), tensor("w", (1024, 256))
    return make_module([x, w], lambda bb, x, w: bb.emit(op.matmul(op.nn.softmax(op.exp(x), axis=-1), w)))


def test_stitched_and_compute_kernels_are_told_apart():
    mod = _softmax_then_matmul()
    stitched, default = stitched_module_time(mod, CUDA, SPEC), default_module_time(mod, CUDA, SPEC)
    assert default.stitched == frozenset() and len(default.compute) == 1
    assert len(stitched.stitched) == 1 and len(stitched.compute) == 1 and not stitched.stitched & stitched.compute
    for priced in (stitched, default):
        (matmul,) = [times for name, _, times in priced.kernels if name in priced.compute]
        assert priced.compute_us() == sum(t.us for t in matmul) and 0 < priced.compute_us() < priced.us
    # The softmax moves 8.4 MB: the only stitched kernel over 8 MB.
    (big,) = stitched.over(8 << 20, stitched_only=True)
    assert big.bytes >= 8 << 20 and len(stitched.over(0, stitched_only=True)) == 1
    assert stitched.us < default.us
