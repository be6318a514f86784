"""tvm-stitch: memory-intensive subgraphs of Relax models stitched into few kernels.

    import tvm, tvm_stitch
    ex = tvm.compile(mod, target=target, relax_pipeline=tvm_stitch.pipeline(target))
    print(tvm_stitch.explain(mod, target))
"""

from .threads import use_all_cores

use_all_cores()

from .explain import explain
from .pipeline import pipeline
from .plan import Intermediate, StitchPlan, ThreadMapping
from .report import StitchReport
from .stitch_pass import StitchError, StitchFusion

__all__ = [
    "pipeline",
    "StitchFusion",
    "explain",
    "StitchPlan",
    "ThreadMapping",
    "Intermediate",
    "StitchReport",
    "StitchError",
]
