"""Targets tvm-stitch accepts, checked before any work is done."""

from __future__ import annotations

import warnings

import tvm
from tvm.target import Target, codegen

from tvm_stitch.errors import TargetError
from tvm_stitch.planning.spec import check_cuda_arch

from schedules.tensorize_guard import NoTensorize

SUPPORTED_KINDS = ("cuda", "llvm")


def as_target(target) -> Target:
    """A Target from a Target, a dict or a string; a TargetError (a ValueError) naming what is wrong
    for an unsupported kind, a malformed CUDA arch or a CPU name LLVM does not know, before TVM
    parses it; TypeError for anything else."""
    if isinstance(target, Target):
        result = target
    elif isinstance(target, (dict, str)):
        if isinstance(target, dict):
            _check_given(target)
        try:
            result = Target(target)
        except (RuntimeError, ValueError, TypeError, KeyError) as err:
            raise TargetError(f"invalid target {target!r}: {str(err).strip().splitlines()[-1]}") from err
    else:
        raise TypeError(f"target must be a tvm.target.Target, a dict or a string, not {type(target).__name__}")
    if result.kind.name not in SUPPORTED_KINDS:
        raise TargetError(
            f"tvm-stitch supports target kinds {', '.join(SUPPORTED_KINDS)}; got {result.kind.name!r}"
        )
    _check_given({"kind": result.kind.name, **{k: result.attrs[k] for k in ("arch", "mcpu", "mtriple")
                                                 if k in result.attrs}})
    return result


def _check_given(attrs: dict) -> None:
    """The CUDA arch or the CPU of a target's attributes checked (before TVM parses them)."""
    if attrs.get("kind") == "cuda" and "arch" in attrs:
        check_cuda_arch(str(attrs["arch"]))
    if attrs.get("kind") == "llvm" and attrs.get("mcpu"):
        check_cpu(str(attrs["mcpu"]), str(attrs.get("mtriple", "") or ""))


def check_cpu(mcpu: str, triple: str = "") -> None:
    """TargetError listing LLVM's CPU names for `triple` (default: this machine's) unless LLVM knows
    `mcpu` (asked before anything reads the target: LLVM would print an error at each use and
    compile for the generic CPU)."""
    triple = triple or codegen.llvm_get_system_triple()
    if codegen.llvm_is_valid_cpu(mcpu, triple):
        return
    known = codegen.llvm_get_cpu_archlist(Target({"kind": "llvm", "mtriple": triple}))
    raise TargetError(f"unknown CPU {mcpu!r} for {triple} (this machine's is {codegen.llvm_get_system_cpu()!r}: "
                      f"tvm_stitch.target.host_target()); LLVM {codegen.llvm_version_major()} knows "
                      f"{', '.join(sorted(str(name) for name in known))}")


def host_target() -> Target:
    """llvm for this machine's CPU model, so code uses its vector ISA (AVX2, AVX-512, ...).

    `{"kind": "llvm"}` alone compiles for generic x86-64 (SSE2): 4-lane
    vectors, and no vector rounding instruction (SSE4.1) for the `floor`
    of fast `exp`, which then calls libm once per lane.
    """
    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})


class GenericCpuWarning(UserWarning):
    """An llvm target without a CPU model: code for the ISA's baseline (x86-64: SSE2)."""


def warn_if_generic_cpu(target: Target) -> None:
    """Warn (once per call site, Python's default) when an llvm target names no CPU model."""
    if target.kind.name == "llvm" and not target.attrs.get("mcpu", None) and not target.attrs.get("mattr", None):
        warnings.warn(
            "llvm target without 'mcpu': code is compiled for the generic baseline (x86-64: SSE2, "
            "4-lane vectors), several times slower than for this machine's CPU; use "
            "tvm_stitch.target.host_target() (or name the CPU: {'kind': 'llvm', 'mcpu': ...})",
            GenericCpuWarning, stacklevel=3)


def backend_passes(target: Target):
    """TVM's per-backend pipeline module (its dispatch, lowering and finalisation passes).

    `relax.pipeline.*_passes` cannot be used: in TVM 0.27 the llvm branch
    refers to names the `cpu_generic` package does not export.
    """
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as cuda_pipeline

        return cuda_pipeline
    from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline

    return cpu_pipeline


def default_pipeline(target: Target) -> tvm.transform.Pass:
    """TVM's own default Relax pipeline for the target (the baseline tvm-stitch is compared with).

    On CUDA, with dlight's tensor-core path switched off before its schedule
    rules run where TVM's Tensorize segfaults (tensorize_guard).
    """
    if target.kind.name != "cuda":
        return backend_passes(target).get_default_pipeline(target)
    backend = backend_passes(target)
    legalize = backend.legalize_passes(target)  # ends with dlight's ApplyDefaultSchedule
    passes = (backend.library_dispatch_passes(target) + legalize[:-1] + [NoTensorize(), legalize[-1]]
              + backend.dataflow_lower_passes(target) + backend.finalize_passes(target))

    @tvm.transform.module_pass(opt_level=0, name="default_pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
