"""The disk compile cache's warm start: a new process's first call of a compiled model, cold and warm.

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python benchmarks/cache_warm_start.py --models mlp,bert --runs 3

Each measurement is a new Python process that imports torch and
tvm_stitch, makes the model and times its first compiled call (dynamo's
trace, aot_autograd, the import to Relax, the key and the build or the
checked load from disk); the imports are timed apart. For each model:
backend="tvm_stitch" with an empty cache directory (cold: a build, written
to the cache), then `--runs` processes on that warm directory, and
Inductor alternating with them, cold (an empty TORCHINDUCTOR_CACHE_DIR)
and warm (its FX graph cache filled by the cold run). Printed: the medians
of the warm runs, the cold run, and each process's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
import tvm_stitch.torch as ts
from tvm_stitch.tools.models import make_model
imported = time.perf_counter() - start
name, backend_name, directory = sys.argv[1:4]
torch.manual_seed(0)
if name == "mlp":
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    inputs = (torch.randn(4, 8),)
else:
    model, inputs = make_model(name, "test")
backend = ts.backend(cache=directory) if backend_name == "tvm_stitch" else "inductor"
spent = [0.0]


def timed(gm, example_inputs):
    begin = time.perf_counter()
    try:
        return backend(gm, example_inputs)
    finally:
        spent[0] += time.perf_counter() - begin


with torch.no_grad():
    compiled = torch.compile(model, backend=timed if backend_name == "tvm_stitch" else backend)
    start = time.perf_counter()
    compiled(*inputs)
    first = time.perf_counter() - start
counters = str(backend.counters) if backend_name == "tvm_stitch" else ""
print(json.dumps({"import_s": imported, "first_call_s": first, "backend_s": spent[0], "counters": counters}))
"""


def _child(model: str, backend: str, directory: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(directory, "inductor"))
    done = subprocess.run([sys.executable, "-c", CHILD, model, backend, os.path.join(directory, "stitch")],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(model: str, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        cold = {backend: _child(model, backend, directory) for backend in ("tvm_stitch", "inductor")}
        warm = {"tvm_stitch": [], "inductor": []}
        for i in range(runs):
            for backend in (("tvm_stitch", "inductor") if i % 2 == 0 else ("inductor", "tvm_stitch")):
                warm[backend].append(_child(model, backend, directory))
    return {"cold": cold, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,bert", help="mlp (Linear, GELU, LayerNorm at 4 x 8) or "
                                                              "models of tvm_stitch/tools/models.py at size test")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for model in args.models.split(","):
        result = _measure(model, args.runs)
        for backend in ("tvm_stitch", "inductor"):
            cold, warm = result["cold"][backend], result["warm"][backend]
            median = statistics.median(r["first_call_s"] for r in warm)
            imports = statistics.median(r["import_s"] for r in warm)
            inside = statistics.median(r["backend_s"] for r in warm)
            each = ", ".join(f"{r['first_call_s']:.2f}" for r in warm)
            print(f"{model:8s} {backend:10s} first call: cold {cold['first_call_s']:.2f} s, warm {median:.2f} s "
                  f"(median of {len(warm)}: {each}); "
                  f"imports {imports:.2f} s" + (f", in the backend {inside:.2f} s; {warm[-1]['counters']}"
                                                 if backend == "tvm_stitch" else ""))


if __name__ == "__main__":
    main()
