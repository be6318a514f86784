"""Targets tvm-stitch accepts, checked before any work is done."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import tvm
from tvm.target import Target

from tvm_stitch.threads import cpu_threads

SUPPORTED_KINDS = ("cuda", "llvm")


def as_target(target) -> Target:
    """A Target from a Target, a dict or a string; a clear error for anything else."""
    if isinstance(target, Target):
        result = target
    elif isinstance(target, (dict, str)):
        try:
            result = Target(target)
        except (RuntimeError, ValueError, TypeError, KeyError) as err:
            raise ValueError(f"invalid target {target!r}: {str(err).strip().splitlines()[-1]}") from err
    else:
        raise TypeError(f"target must be a tvm.target.Target, a dict or a string, not {type(target).__name__}")
    if result.kind.name not in SUPPORTED_KINDS:
        raise ValueError(
            f"tvm-stitch supports target kinds {', '.join(SUPPORTED_KINDS)}; got {result.kind.name!r}"
        )
    return result


def host_target() -> Target:
    """llvm for this machine's CPU model, so code uses its vector ISA (AVX2, AVX-512, ...).

    `{"kind": "llvm"}` alone compiles for generic x86-64 (SSE2): 4-lane
    vectors, and no vector rounding instruction (SSE4.1) for the `floor`
    of fast `exp`, which then calls libm once per lane.
    """
    return Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


@dataclass(frozen=True)
class CpuFacts:
    """What the CPU schedules need to know of an llvm target."""

    cpu: str  # the CPU model the code is compiled for ("generic" when the target names none)
    vector_bits: int  # the widest vector register
    vector_registers: int  # architectural vector registers (accumulators of a matmul tile live there)


def cpu_facts(target: Target) -> CpuFacts:
    """The CPU an llvm target compiles for: its model, vector width and vector register count.

    The width comes from the CPU's features as LLVM knows them for the
    target's `mcpu` / `mattr` (x86: AVX-512F 512 bits, AVX 256, else SSE's
    128; other ISAs 128, NEON's). `llvm_get_vector_width` is not used: in
    TVM 0.27 it answers 512 for every x86 CPU model on an AVX-512 host.
    AVX-512 has 32 vector registers, narrower x86 ISAs 16, Arm's NEON 32.
    """
    if target.kind.name != "llvm":
        raise ValueError(f"cpu_facts needs an llvm target, not {target.kind.name!r}")
    cpu = str(target.attrs.get("mcpu", "") or "generic")
    features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    bits = 512 if "avx512f" in features else 256 if "avx" in features else 128
    triple = str(target.attrs.get("mtriple", "") or "")
    arm = triple.startswith(("aarch64", "arm")) or "neon" in features
    return CpuFacts(cpu=cpu, vector_bits=bits, vector_registers=32 if arm or bits >= 512 else 16)


class GenericCpuWarning(UserWarning):
    """An llvm target without a CPU model: code for the ISA's baseline (x86-64: SSE2)."""


def warn_if_generic_cpu(target: Target) -> None:
    """Warn (once per call site, Python's default) when an llvm target names no CPU model."""
    if target.kind.name == "llvm" and cpu_facts(target).cpu == "generic" and not target.attrs.get("mattr", None):
        warnings.warn(
            "llvm target without 'mcpu': code is compiled for the generic baseline (x86-64: SSE2, "
            "4-lane vectors), several times slower than for this machine's CPU; use "
            "tvm_stitch.target.host_target() (or name the CPU: {'kind': 'llvm', 'mcpu': ...})",
            GenericCpuWarning, stacklevel=3)


def describe_target(target: Target) -> str:
    """Which machine the plans are made for, in words (the header of explain's report)."""
    if target.kind.name == "llvm":
        facts = cpu_facts(target)
        cpu = ("generic CPU (no mcpu; tvm_stitch.target.host_target() names this machine's)"
               if facts.cpu == "generic" else f"CPU {facts.cpu}")
        return f"llvm, {cpu}, {facts.vector_bits}-bit vectors, {cpu_threads()} threads"
    arch = target.attrs.get("arch", None)
    return f"{target.kind.name}{', ' + str(arch) if arch else ''}"


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
    """TVM's own default Relax pipeline for the target (the baseline we compare with)."""
    return backend_passes(target).get_default_pipeline(target)
