"""Shared helpers: small Relax graphs, targets, and compiling CUDA source with nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "TVM_NUM_THREADS" not in os.environ:
    # parallel test workers share the cores: TVM's spinning thread pools would oversubscribe them
    os.environ["TVM_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) //
                                            int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from tvm_stitch.tools.workloads import relax_blocks  # noqa: E402 - after the threads are set
import tvm
from tvm import relax, tirx

from tvm_stitch.simt import opencl_run
from attention_reference import reference_func
from tvm_stitch.simt.oclgrind_fit import fitting_specs
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.rewrites.attention import kernel_for
from tvm_stitch.planning.attention import plan_attention
from tvm_stitch.planning.spec import TargetSpec


MAX_WORKERS = 4  # each worker holds torch, transformers and TVM builds of whole models in memory


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core this process may use, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def nvcc(source: str, tmp_path, *, arch: str = "sm_90", ptx: bool = False, name: str = "kernels",
         timeout: int = 300) -> str:
    """Compile CUDA `source` with nvcc to a cubin for `arch` (to PTX with `ptx`), asserting that it
    compiles; returns nvcc's output, for a cubin with ptxas's report (-v: registers, shared memory,
    spills per kernel)."""
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    if ptx:
        command = [NVCC, "--ptx", f"-arch={arch}", "-w", "-o", str(tmp_path / f"{name}.ptx"), str(path)]
    else:
        command = [NVCC, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", str(tmp_path / f"{name}.cubin"), str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def opencl_device(oclgrind: bool):
    """The OpenCL device of the SIMT checker (Oclgrind's, or pocl's); skips the test without it."""
    try:
        return opencl_run.device_for(oclgrind)
    except opencl_run.NoOpenclDevice as err:
        pytest.skip(str(err))


def attention_simt(shape, oclgrind: bool, points: list | None = None):
    """The fused attention kernel of `shape` (planning/attention.AttentionShape), planned for sm_90
    (within the OpenCL device's limits under Oclgrind), run under the SIMT checker against its
    reference at `points` (symbolic sizes; None: their defaults); skips without the device."""
    device = opencl_device(oclgrind)
    spec = TargetSpec.from_target(CUDA)
    if oclgrind:
        spec = fitting_specs(spec, device)[0]
    ref = reference_func(shape)
    return check_kernel("fused_attention", kernel_for(plan_attention(shape, spec)),
                        [Reference(ref, tuple(range(len(ref.params))))], device, oclgrind, 0, points=points)


def make_module(params: list, body) -> tvm.IRModule:
    """A Relax module whose main takes `params` and returns body(bb, *params)."""
    return relax_blocks.function(params, body)


def symbolic_softmax(shape, bounds: tuple | None = None) -> tvm.IRModule:
    """softmax over the last axis of x of `shape` (its size `n` between `bounds`, (lower, upper), if given)."""
    mod = make_module([tensor("x", shape)], lambda bb, x: relax.op.nn.softmax(x, axis=-1))
    if bounds is not None:
        mod["main"] = (mod["main"].with_attr("tir_var_lower_bound", {"n": bounds[0]})
                       .with_attr("tir_var_upper_bound", {"n": bounds[1]}))
    return mod


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


NORM_EPS = 1e-5


def layer_norm_module(shape) -> tvm.IRModule:
    """LayerNorm over the last axis of x of `shape`, with a scale and a shift of the row's length."""
    return make_module([tensor("x", shape), tensor("g", shape[-1:]), tensor("b", shape[-1:])],
                       lambda _bb, x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=NORM_EPS))


def rms_norm_module(shape) -> tvm.IRModule:
    """RMSNorm over the last axis of x of `shape` (mean of squares, divide by its root), with a scale."""
    def body(_bb, x, w):
        mean_square = relax.op.mean(relax.op.multiply(x, x), axis=-1, keepdims=True)
        return relax.op.multiply(relax.op.divide(x, relax.op.sqrt(relax.op.add(mean_square, relax.const(NORM_EPS)))), w)
    return make_module([tensor("x", shape), tensor("w", shape[-1:])], body)


def np_layer_norm(x, g, b):
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + NORM_EPS) * g + b


def np_rms_norm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + NORM_EPS) * w


def kernel_with(built, attr: str) -> tirx.PrimFunc:
    """The PrimFunc of a build's lowered module that has the attribute `attr`."""
    return next(f for _, f in built.lowered.functions_items()
                if isinstance(f, tirx.PrimFunc) and f.attrs is not None and attr in f.attrs)


def tensor(name: str, shape, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(tuple(shape), dtype))


def static_shape(var: relax.Var) -> tuple:
    return tuple(int(dim) for dim in var.ty.shape)


def legalized(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.transform.Sequential(
        [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    )(mod)


def fused(mod: tvm.IRModule) -> tvm.IRModule:
    """The module as StitchFusion sees it: legalized and grouped by FuseOps."""
    return tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
        ]
    )(mod)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def one_rank(monkeypatch):
    """A torch.distributed world of this process alone (gloo on 127.0.0.1, a free port)."""
    import torch.distributed as dist

    from tvm_stitch.tools.dist_parity import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
