"""CUDA launches, modeled traffic and the threads of every kernel over 8 MB, read from the built module.

For the suite at bench size and graphs with column sums, column means,
middle-axis sums, whole-tensor reductions and cross-entropy over a symbolic
row count: the stitched sm_90 build's launches, its modeled MB (every
PrimFunc's modeled traffic, per call), and for each kernel that moves at
least 8 MB its threads (blocks x threads per block, from the scheduled TIR's
thread extents). Nothing runs on a GPU.
Usage: python benchmarks/column_reduction_threads.py [OUT.md] [MODEL:STEP ...]
(model steps, e.g. bert:backward, at bench size; needs the torch extra)
"""

import sys

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches, primfunc_calls
from tvm_stitch.tools.workloads import SIZES, SUITE
from tvm_stitch.tools.workloads.relax_blocks import function as _module, tensor
from tables import emit

CUDA = {"kind": "cuda", "arch": "sm_90"}
BIG = 8 << 20
op = relax.op


def _t(name, shape, dtype="float32"):
    return tensor(name, shape, dtype)


def _cross_entropy(rows, vocab):
    def body(bb, logits, labels):
        mx = bb.emit(op.max(logits, axis=[-1], keepdims=True))
        shifted = bb.emit(op.subtract(logits, mx))
        lse = bb.emit(op.log(op.sum(op.exp(shifted), axis=[-1], keepdims=True)))
        return bb.emit(op.nn.nll_loss(op.subtract(shifted, lse), labels, reduction="mean"))

    return _module([_t("logits", (rows, vocab)), _t("labels", (rows,), "int64")], body)


def own_graphs() -> dict:
    x = _t("x", (4096, 1024))
    y = _t("y", (4096, 768))
    b = _t("b", (768,))
    z = _t("z", (2, 1024, 1024))
    s = _t("s", (750000, 32))
    w = _t("w", (4096, 2048))
    return {
        "column sum of exp(x)*x 4096x1024": _module([x], lambda bb, x: bb.emit(
            op.sum(op.multiply(op.exp(x), x), axis=[0]))),
        "column mean of x+b 4096x768": _module([y, b], lambda bb, y, b: bb.emit(op.mean(op.add(y, b), axis=[0]))),
        "middle-axis sum 2x1024x1024": _module([z], lambda bb, z: bb.emit(op.sum(op.multiply(z, z), axis=[1]))),
        "column sum 750000x32": _module([s], lambda bb, s: bb.emit(op.sum(op.multiply(s, s), axis=[0]))),
        "scalar mean of x*x 4096x2048": _module([w], lambda bb, w: bb.emit(op.mean(op.multiply(w, w)))),
        "global norm 4096x2048": _module([w], lambda bb, w: bb.emit(op.sqrt(op.sum(op.multiply(w, w))))),
        "cross-entropy n x 8192 (symbolic n)": _cross_entropy(tirx.Var("n", "int64"), 8192),
    }


def _kernel_threads(func: tirx.PrimFunc) -> list:
    """Threads of each kernel (root loop nest bound to blockIdx) of a scheduled PrimFunc; a
    symbolic extent gives None."""
    body = func.body
    if not hasattr(body, "block"):
        return []
    root = body.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    out = []
    for nest in nests:
        extents = {}

        def visit(loop, extents=extents):
            if loop.kind == tirx.ForKind.THREAD_BINDING:
                extents[loop.thread_binding.thread_tag] = loop.extent

        tvm_ffi.structural_walk(nest, (tirx.For, visit), order="pre")
        if extents:
            values = [int(e) if isinstance(e, tirx.IntImm) else None for e in extents.values()]
            out.append(None if None in values else int(np.prod(values)))
    return out


def measure(mod) -> tuple:
    """(launches, modeled MB, [threads of each kernel of a PrimFunc moving >= 8 MB])."""
    spec = TargetSpec.from_target(tvm.target.Target(CUDA))
    built = build(mod, CUDA, stitched=True)
    calls = primfunc_calls(built.lowered)
    total, big = 0, []
    for gv, func in built.lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc) or gv.name_hint not in calls:
            continue
        traffic = modeled_traffic(func, spec)
        if traffic is None:
            continue
        total += traffic.total * calls[gv.name_hint]
        if traffic.total >= BIG:
            big.extend(t for t in _kernel_threads(func) if t is not None)
    return count_launches(built.lowered, built.executable), total / 1e6, big


def main(out_path: str = "", *steps: str) -> None:
    graphs = {name: SUITE[name].build("float32", SIZES["bench"]) for name in SUITE}
    graphs.update(own_graphs())
    if steps:
        from tvm_stitch.tools.model_bench import import_step
        graphs = {step: import_step(*step.split(":"), "bench")[0] for step in steps}
    lines = ["| graph | launches | modeled MB | threads of each kernel >= 8 MB |", "|---|---|---|---|"]
    for name, mod in graphs.items():
        print(name, file=sys.stderr, flush=True)
        launches, mb, big = measure(mod)
        lines.append(f"| {name} | {launches} | {mb:.1f} | {', '.join(str(t) for t in big) or '-'} |")
    emit(lines, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
