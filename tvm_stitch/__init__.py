"""tvm-stitch: memory-intensive subgraphs of Relax models stitched into few kernels.

    import tvm, tvm_stitch
    ex = tvm.compile(mod, target=target, relax_pipeline=tvm_stitch.pipeline(target))
    print(tvm_stitch.explain(mod, target))
    tvm_stitch.TargetSpec.from_target(target)  # the hardware facts the plans are made for

    mod = tvm_stitch.from_torch(torch_model, (example_input,))  # PyTorch, through torch.export
    torch.compile(torch_model, backend="tvm_stitch")  # or tvm_stitch.torch.backend(...): docs/torch-compile.md
"""

from tvm_stitch.threads import use_all_cores

use_all_cores()

from tvm_stitch.errors import TargetError
from tvm_stitch.disco import import_disco

import_disco()

from tvm_stitch.explain import explain
from tvm_stitch.frontend import UnsupportedModelError, from_torch
from tvm_stitch.pipeline import pipeline
from tvm_stitch.planning.plan import Intermediate, Phase, PhaseRole, StitchPlan, ThreadMapping
from tvm_stitch.planning.spec import TargetSpec, UnknownArchWarning
from tvm_stitch.report import StitchReport
from tvm_stitch.stitch import StitchError, StitchFusion


def __getattr__(name):
    """`tvm_stitch.torch` (the torch.compile backend) is imported on first use: the core does not need PyTorch."""
    if name == "torch":
        import importlib

        return importlib.import_module("tvm_stitch.torch")
    raise AttributeError(f"module 'tvm_stitch' has no attribute {name!r}")


__all__ = [
    "pipeline",
    "StitchFusion",
    "explain",
    "TargetSpec",
    "TargetError",
    "UnknownArchWarning",
    "from_torch",
    "UnsupportedModelError",
    "StitchPlan",
    "ThreadMapping",
    "Intermediate",
    "Phase",
    "PhaseRole",
    "StitchReport",
    "StitchError",
]
