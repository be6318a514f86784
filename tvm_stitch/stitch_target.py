"""The target a build is for and the TargetSpec its plans are made for, made once from what the caller gave."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_stitch.planning.spec import DEFAULT_ARCH, TargetSpec
from tvm_stitch.target import as_target


@dataclass(frozen=True)
class StitchTarget:
    """`target`: what kernels are built for. `spec`: the hardware the plans are made for (the
    target's, an emulated GPU's, or one given). `target_spec`: the target's own facts, for the
    schedules of what the stitch pass leaves (the same object as `spec` unless emulated or given)."""

    target: Target
    spec: TargetSpec
    target_spec: TargetSpec

    @property
    def family(self) -> str:
        """The family the plans are made for: "cuda" (built for a GPU, or emulated on llvm) or "cpu"."""
        return self.spec.family

    @property
    def builds_cuda(self) -> bool:
        """Whether kernels are built for a GPU (False on llvm, where CUDA plans may be emulated)."""
        return self.target.kind.name == "cuda"

    @property
    def kernel_spec(self) -> TargetSpec:
        """The spec of the kernels a Relax rewrite builds whole (attention, scatters): `spec`, unless the
        plans are emulated (CUDA plans on llvm, whose thread-free schedules only the stitch pass makes):
        then the target's own."""
        return self.target_spec if self.family == "cuda" and not self.builds_cuda else self.spec

    @staticmethod
    def of(target) -> "StitchTarget":
        """`target` if it is a StitchTarget, else one made from it (a Target, dict or string)."""
        return target if isinstance(target, StitchTarget) else StitchTarget.make(target)

    @staticmethod
    def make(target, emulate=None, spec: TargetSpec | None = None) -> "StitchTarget":
        """From a Target, dict or string; `emulate` ("cuda" or a cuda target, llvm targets only) plans
        as for that GPU; `spec` plans for that TargetSpec (its family must be the one planned for)."""
        return StitchTarget.checked(as_target(target), emulated(emulate), spec)

    @staticmethod
    def checked(target: Target, emulation: Target | None, spec: TargetSpec | None) -> "StitchTarget":
        """From a normalised `target` and `emulation` (see `emulated`)."""
        check_spec(spec)
        if emulation is not None and target.kind.name != "llvm":
            raise ValueError(f"emulate={emulation.kind.name!r} needs an llvm target, not {target.kind.name!r}")
        own = TargetSpec.from_target(target)
        planned = TargetSpec.from_target(emulation) if emulation is not None else own
        if spec is not None and spec.family != planned.family:
            raise ValueError(f"spec is for {spec.family}, but the plans are for {planned.family}")
        return StitchTarget(target, spec if spec is not None else planned, own)


def check_spec(spec) -> None:
    """TypeError unless `spec` is None or a TargetSpec."""
    if spec is not None and not isinstance(spec, TargetSpec):
        raise TypeError(f"spec must be a TargetSpec, not {type(spec).__name__}")


def emulated(emulate) -> Target | None:
    """The cuda Target that `emulate` asks plans for (None: no emulation)."""
    if emulate is None:
        return None
    if isinstance(emulate, str) and emulate == "cuda":
        return Target({"kind": "cuda", "arch": DEFAULT_ARCH})
    try:
        target = as_target(emulate)
    except (TypeError, ValueError) as err:
        raise ValueError(f"emulate must be None, 'cuda' or a cuda target, not {emulate!r} ({err})") from err
    if target.kind.name != "cuda":
        raise ValueError(f"emulate must be None, 'cuda' or a cuda target, not {emulate!r}")
    return target
