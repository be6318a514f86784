"""Short rows across the vector lanes on this machine's CPU (llvm, host target): float32 softmax, RMSNorm and
LayerNorm over (n, LENGTH) rows, n static, built with the lanes across rows and along each row (the plan's rule
forced either way, whatever it chooses), timed in alternating rounds in one process
(tools/build.alternating_times), with numerics checked against numpy. Prints milliseconds per call and the ratio
along / across (above 1: across rows is faster), and the rule's choice. Run with TVM_NUM_THREADS set to the
cores, from the repository root.
Usage: TVM_NUM_THREADS=2 python benchmarks/cpu_across_rows.py ROUNDS ROWS LENGTH...
"""

import os
import sys
from unittest import mock

import numpy as np

from tvm_stitch.planning.cpu import row_resident
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import alternating_times, build, run_cpu, vm_round

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import (layer_norm_module, np_layer_norm, np_rms_norm, np_softmax, rms_norm_module,  # noqa: E402
                      symbolic_softmax)

def graphs(rows: int, length: int, rng) -> dict:
    """name -> (module, inputs, numpy reference)."""
    x = rng.standard_normal((rows, length)).astype("float32")
    w, b = (rng.standard_normal(length).astype("float32") for _ in range(2))
    return {
        "softmax": (symbolic_softmax((rows, length)), [x], np_softmax(x)),
        "rmsnorm": (rms_norm_module((rows, length)), [x, w], np_rms_norm(x, w)),
        "layernorm": (layer_norm_module((rows, length)), [x, w, b], np_layer_norm(x, w, b)),
    }


def built(mod, across: bool | None):
    """The stitched build with the lanes across rows (True), along each row (False) or as the rule chooses."""
    if across is None:
        return build(mod, host_target(), stitched=True)
    with mock.patch.object(row_resident, "lanes_across", lambda *_args: across):
        return build(mod, host_target(), stitched=True)


def main(rounds: str, rows: str, *lengths: str) -> None:
    rng = np.random.default_rng(0)
    for length in map(int, lengths):
        for name, (mod, inputs, reference) in graphs(int(rows), length, rng).items():
            made = {"along": built(mod, False), "across": built(mod, True)}
            for way, out in made.items():
                error = np.abs(run_cpu(out.executable, inputs)[0] - reference).max()
                assert error < 1e-4, (name, length, way, error)
            chosen = built(mod, None).report.groups[0].plan.mapping.across
            ms = alternating_times({way: vm_round(out.executable, inputs) for way, out in made.items()}, int(rounds))
            print(f"{name} ({rows}, {length}): along {ms['along']:.3f} ms, across {ms['across']:.3f} ms, "
                  f"along/across {ms['along'] / ms['across']:.2f}; rule: {'across' if chosen else 'along'} | "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
