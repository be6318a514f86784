"""The stitch pass in parts: records (records.py), one group's kernel (kernel_maker.py), one block's groups
(block_rewriter.py, bindings.py), and the module pass (module_pass.py: StitchFusion)."""

from tvm_stitch.stitch.module_pass import StitchFusion, stitch_module
from tvm_stitch.stitch.records import DEFAULT_FUSION, FUSION_METHODS, StitchError

__all__ = ["DEFAULT_FUSION", "FUSION_METHODS", "StitchError", "StitchFusion", "stitch_module"]
