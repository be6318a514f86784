"""Targets named wrongly: a malformed CUDA arch or a CPU LLVM does not know is refused with the
known ones listed; a well-formed arch without facts is planned with the nearest known one's and a
warning naming them."""

import warnings

import pytest
import tvm
from tvm.target import codegen

import tvm_stitch
from tvm_stitch import TargetSpec
from tvm_stitch import TargetError, UnknownArchWarning
from tvm_stitch.planning.spec import known_archs
from tvm_stitch.target import as_target


def test_an_unknown_cpu_is_refused_with_llvm_s_names_and_no_llvm_errors(capfd):
    """LLVM printed 'is not valid ... using default -mcpu=generic' at each use (twenty times for
    one explain) and the plan said 'cpu notacpu'."""
    known = [str(name) for name in codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"}))]
    with pytest.raises(TargetError, match="unknown CPU 'notacpu'") as raised:
        tvm_stitch.pipeline({"kind": "llvm", "mcpu": "notacpu"})
    assert isinstance(raised.value, ValueError)
    assert all(name in str(raised.value) for name in known)
    assert "not valid" not in capfd.readouterr().err


def test_a_cpu_of_another_triple_is_checked_against_that_triple(capfd):
    assert as_target({"kind": "llvm", "mcpu": "cortex-a72", "mtriple": "aarch64-linux-gnu"}).kind.name == "llvm"
    with pytest.raises(TargetError, match="unknown CPU 'skylake' for aarch64-linux-gnu.*cortex-a72"):
        as_target({"kind": "llvm", "mcpu": "skylake", "mtriple": "aarch64-linux-gnu"})
    assert "not valid" not in capfd.readouterr().err


@pytest.mark.parametrize("arch", ["foo", "sm_x", "compute_90", "sm_90ab"])
def test_a_malformed_arch_is_refused_with_the_known_ones(arch):
    with pytest.raises(TargetError, match=f"unknown CUDA arch '{arch}'.*sm_70, .*sm_90"):
        as_target({"kind": "cuda", "arch": arch})


def test_a_malformed_arch_tvm_accepts_is_refused_before_planning():
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_x"})  # TVM checks only the sm_ prefix
    with pytest.raises(TargetError, match="sm_x"):
        as_target(target)
    with pytest.raises(TargetError, match="sm_x"):
        TargetSpec.from_target(target)


def test_a_newer_arch_is_planned_with_the_newest_known_facts_and_a_warning():
    newest = known_archs()[-1]
    with pytest.warns(UnknownArchWarning, match=f"sm_999 .* planned with {newest}'s"):
        spec = TargetSpec.from_target(as_target({"kind": "cuda", "arch": "sm_999"}))
    assert (spec.arch, spec.sms) == ("sm_999", TargetSpec.from_target(as_target({"kind": "cuda", "arch": newest})).sms)


def test_an_arch_between_known_ones_takes_the_older_one_s_facts_with_a_warning():
    with pytest.warns(UnknownArchWarning, match="sm_87 .* planned with sm_86's"):
        spec = TargetSpec.from_target(as_target({"kind": "cuda", "arch": "sm_87"}))
    assert spec.sms == TargetSpec.from_target(as_target({"kind": "cuda", "arch": "sm_86"})).sms


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_known_arch_plans_without_a_warning(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TargetSpec.from_target(as_target({"kind": "cuda", "arch": arch})).arch == arch


def test_an_emulated_gpu_with_a_malformed_arch_says_why():
    with pytest.raises(ValueError, match="emulate must be .*unknown CUDA arch 'sm_x'"):
        tvm_stitch.pipeline({"kind": "llvm"}, emulate={"kind": "cuda", "arch": "sm_x"})
