"""PNG plots of a bench run (matplotlib, the optional `plot` extra).

Per graph and per model: CUDA kernel launches and modeled global-memory
bytes, TVM's default vs tvm-stitch; per graph: CPU speedups over TVM's
default and over torch.compile, all from the same run.
"""

from __future__ import annotations

import math

MISSING = "no PNG plots: matplotlib is not installed (pip install 'tvm-stitch[plot]')"


def _bars(ax, labels: list, series: dict, title: str, log: bool = False) -> None:
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))], values, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)


def plot_results(rows: list, model_rows: list, stem: str) -> list:
    """Writes <stem>-graphs.png (and <stem>-models.png with model rows); returns the paths written.

    Without matplotlib: writes nothing, returns [] and says so on stderr.
    """
    import sys

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=sys.stderr)
        return []
    paths = []
    if rows:
        labels = [f"{r.graph} {r.dtype}" for r in rows]
        fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.5 * len(rows)), 12))
        _bars(axes[0], labels, {"TVM default": [r.launches_default for r in rows],
                                "tvm-stitch": [r.launches_stitched for r in rows]}, "CUDA kernel launches per call")
        _bars(axes[1], labels, {"TVM default": [r.mb_default for r in rows],
                                "tvm-stitch": [r.mb_stitched for r in rows],
                                "ideal": [r.mb_ideal for r in rows]}, "modeled CUDA global-memory MB per call")
        speedups = {"over TVM default": [r.speedup for r in rows]}
        if any(not math.isnan(r.torch_compile_ms) for r in rows):
            speedups["over torch.compile"] = [r.vs_torch_compile for r in rows]
        _bars(axes[2], labels, speedups, "CPU speedup of tvm-stitch (same run; above 1: faster)", log=True)
        axes[2].axhline(1.0, color="black", linewidth=0.8)
        fig.tight_layout()
        paths.append(f"{stem}-graphs.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    if model_rows:
        labels = [f"{r.model} {r.step}" + ("" if r.dtype == "float32" else f" {r.dtype}") for r in model_rows]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        _bars(axes[0], labels, {"TVM default": [r.memory_default for r in model_rows],
                                "tvm-stitch": [r.memory_stitched for r in model_rows]},
              "memory-intensive CUDA launches per step")
        _bars(axes[1], labels, {"TVM default": [r.mb_default for r in model_rows],
                                "tvm-stitch": [r.mb_stitched for r in model_rows]}, "modeled CUDA MB per step")
        fig.tight_layout()
        paths.append(f"{stem}-models.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
