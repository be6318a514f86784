"""First-call compile time of torch.compile in a new process, cold and warm, tvm_stitch against Inductor.

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python benchmarks/cache_warm_start.py --models mlp,bert --runs 3
    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python benchmarks/cache_warm_start.py \
        --models bert,gpt2-hf,llama-hf,convnext --size cpu --runs 3

Each measurement is a new Python process that imports torch and
tvm_stitch, makes the model and times its first compiled call (dynamo's
trace, aot_autograd, the import to Relax, the key and the build or the
checked load from disk); the imports are timed apart. Each run, for each
backend in alternating order: a cold process with empty cache directories
(backend="tvm_stitch" with an empty `cache=` directory; Inductor with an
empty TORCHINDUCTOR_CACHE_DIR, so neither its FX graph cache nor its
compiled C++ kernels are reused), then a warm process on the directory the
cold one filled. `--step train` times the first training step instead
(forward, the mean of the output's squares, backward, AdamW's step compiled
with the same backend). Printed: the medians of the cold and the warm runs
and each process's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BACKENDS = ("tvm_stitch", "inductor", "eager")

CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
import tvm_stitch.torch as ts
from tvm_stitch.tools.torch_compile_bench import model_output, prepared_model
imported = time.perf_counter() - start
name, size, step, backend_name, directory = sys.argv[1:6]
torch.manual_seed(0)
if name == "mlp":
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    inputs = (torch.randn(4, 8),)
else:
    model, inputs = prepared_model(name, size, train=step == "train")
backend = ts.backend(cache=directory) if backend_name == "tvm_stitch" else backend_name
spent = [0.0]


def timed(gm, example_inputs):
    begin = time.perf_counter()
    try:
        return backend(gm, example_inputs)
    finally:
        spent[0] += time.perf_counter() - begin


chosen = timed if backend_name == "tvm_stitch" else backend
compiled = torch.compile(model, backend=chosen)
start = time.perf_counter()
if step == "forward":
    with torch.no_grad():
        compiled(*inputs)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model_output(compiled(*inputs)).pow(2).mean().backward()
    torch.compile(optimizer.step, backend=chosen)()
first = time.perf_counter() - start
counters = str(backend.counters) if backend_name == "tvm_stitch" else ""
print(json.dumps({"import_s": imported, "first_call_s": first, "backend_s": spent[0], "counters": counters}))
"""


def _child(model: str, size: str, step: str, backend: str, directory: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(directory, "inductor"))
    done = subprocess.run([sys.executable, "-c", CHILD, model, size, step, backend,
                           os.path.join(directory, "stitch")], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(model: str, size: str, step: str, runs: int) -> dict:
    """{"cold": {backend: [record]}, "warm": {backend: [record]}}: `runs` rounds, backends alternating."""
    result = {"cold": {b: [] for b in BACKENDS}, "warm": {b: [] for b in BACKENDS}}
    for i in range(runs):
        for backend in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            with tempfile.TemporaryDirectory() as directory:
                for state in ("cold", "warm"):
                    result[state][backend].append(_child(model, size, step, backend, directory))
    return result


def _line(model: str, backend: str, result: dict) -> str:
    cold, warm = result["cold"][backend], result["warm"][backend]

    def median(records, key="first_call_s"):
        return statistics.median(r[key] for r in records)

    each = "; ".join(f"{c['first_call_s']:.2f}/{w['first_call_s']:.2f}" for c, w in zip(cold, warm))
    inside = (f", in the backend {median(warm, 'backend_s'):.2f} s warm; {warm[-1]['counters']}"
              if backend == "tvm_stitch" else "")
    return (f"{model:9s} {backend:10s} first call: cold {median(cold):.2f} s, warm {median(warm):.2f} s "
            f"(cold/warm per run: {each}); imports {median(warm, 'import_s'):.2f} s{inside}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,bert", help="mlp (Linear, GELU, LayerNorm at 4 x 8) or "
                                                              "models of tvm_stitch/tools/models.py")
    parser.add_argument("--size", default="test", help="a size of tools/models.SIZES (test, cpu, bench)")
    parser.add_argument("--step", default="forward", choices=("forward", "train"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for model in args.models.split(","):
        result = _measure(model, args.size, args.step, args.runs)
        for backend in BACKENDS:
            print(_line(model, backend, result), flush=True)


if __name__ == "__main__":
    main()
