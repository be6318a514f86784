"""Shared helpers: small Relax graphs, targets, and running a build on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def make_module(params: list, body) -> tvm.IRModule:
    """A Relax module whose main takes `params` and returns body(bb, *params)."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


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
