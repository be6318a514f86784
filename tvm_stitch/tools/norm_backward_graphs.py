"""Norm backward graphs at any size and dtype: the suite's LayerNorm backward, RMSNorm and BatchNorm
backward (workload modules outside the suite's list), one builder each for the tests and benchmarks."""

from __future__ import annotations

from tvm_stitch.tools.workloads import SUITE, SuiteGraph, batchnorm_backward, rmsnorm_backward

GRAPHS = {
    "layernorm_backward": SUITE["layernorm_backward"],
    "rmsnorm_backward": SuiteGraph("rmsnorm_backward", rmsnorm_backward.DESCRIPTION, rmsnorm_backward),
    "batchnorm_backward": SuiteGraph("batchnorm_backward", batchnorm_backward.DESCRIPTION, batchnorm_backward),
}


def norm_backward(name: str, dtype: str = "float32", **sizes) -> tuple:
    """(Relax module, SuiteGraph, dims) of a norm backward graph; `sizes`: rows and cols (LayerNorm,
    RMSNorm) or batch, channels, height and width (BatchNorm)."""
    if name not in GRAPHS:
        raise ValueError(f"norm backward graph must be one of {sorted(GRAPHS)}, not {name!r}")
    graph = GRAPHS[name]
    return graph.build(dtype, sizes), graph, sizes
