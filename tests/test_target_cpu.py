"""The CPU a plan is made for: facts read from the llvm target, a warning for a target that names
no CPU, and explain's report header."""

import warnings

import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch import TargetSpec
from tvm_stitch.target import GenericCpuWarning, host_target

from conftest import make_module, tensor


def _mod():
    x = tensor("x", (64, 128))
    return make_module([x], lambda bb, x: bb.emit(relax.op.nn.softmax(relax.op.exp(x), axis=-1)))


def test_spec_reads_the_vector_isa_of_a_named_and_a_generic_cpu():
    named = TargetSpec.from_target(tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    assert named.arch == "skylake-avx512" and named.vector_bytes == 64 and named.vector_registers == 32
    avx2 = TargetSpec.from_target(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    assert avx2.vector_bytes == 32 and avx2.vector_registers == 16
    generic = TargetSpec.from_target(tvm.target.Target({"kind": "llvm"}))
    assert generic.arch == "" and generic.vector_bytes == 16


def test_plain_llvm_warns_and_names_host_target():
    with pytest.warns(GenericCpuWarning, match=r"tvm_stitch\.target\.host_target\(\)"):
        tvm_stitch.pipeline({"kind": "llvm"})
    with pytest.warns(GenericCpuWarning):
        tvm_stitch.explain(_mod(), {"kind": "llvm"})


def test_named_cpu_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenericCpuWarning)
        tvm_stitch.pipeline(host_target())
        tvm_stitch.pipeline({"kind": "cuda", "arch": "sm_90"})


def test_explain_says_which_cpu_the_plans_are_for():
    target = host_target()
    header = tvm_stitch.explain(_mod(), target).table().splitlines()[0]
    assert header.startswith(f"plans made for cpu {target.attrs['mcpu']}:")
    with pytest.warns(GenericCpuWarning):
        generic = tvm_stitch.explain(_mod(), {"kind": "llvm"}).table().splitlines()[0]
    assert generic.startswith("plans made for cpu generic") and "host_target()" in generic
    cuda = tvm_stitch.explain(_mod(), {"kind": "cuda", "arch": "sm_90"}).table().splitlines()[0]
    assert cuda.startswith("plans made for cuda sm_90: 132 SMs")
