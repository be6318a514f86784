"""Float32 matmuls on the CPU in isolation: tvm-stitch's llvm pipeline (schedules/cpu/contraction.py)
against torch.matmul and numpy, in alternating rounds, GFLOP/s.

    TVM_NUM_THREADS=2 python benchmarks/cpu_matmul.py --shapes 6272x96x384 6272x384x96 --epilogue gelu

Torch runs with as many threads as TVM_NUM_THREADS (default: the cores), numpy with its BLAS's
(OPENBLAS_NUM_THREADS); numpy computes the matmul and bias only, never the GELU.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tvm
from tvm import relax

from tvm_stitch.pipeline import pipeline
from tvm_stitch.target import host_target
from tvm_stitch.tools.workloads import relax_blocks


def _module(m: int, k: int, n: int, epilogue: str) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))

    def body(bb, x, w, b):
        y = relax.op.matmul(x, w)
        if epilogue != "none":
            y = relax.op.add(y, b)
        if epilogue == "gelu":
            y = relax.op.nn.gelu(y)
        return bb.emit(y)

    return relax_blocks.function([x, w, b], body)


def _per_call_ms(fn, min_ms: float) -> float:
    calls, start = 0, time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < min_ms:
        fn()
        calls += 1
    return (time.perf_counter() - start) * 1e3 / calls


def measure(m: int, k: int, n: int, epilogue: str, rounds: int, round_ms: float) -> dict:
    import torch

    target = host_target()
    with target:
        lowered = pipeline(target)(_module(m, k, n, epilogue))
    vm = relax.VirtualMachine(tvm.compile(lowered, target=target, relax_pipeline=None), tvm.cpu())
    rng = np.random.default_rng(0)
    a, w, bias = (rng.standard_normal(s).astype("float32") for s in ((m, k), (k, n), (n,)))
    args = [tvm.runtime.tensor(v) for v in (a, w, bias)]
    ta, tw, tb = (torch.from_numpy(v) for v in (a, w, bias))
    gelu = torch.nn.functional.gelu

    def torch_call():
        y = torch.matmul(ta, tw)
        if epilogue != "none":
            y = y + tb
        return gelu(y) if epilogue == "gelu" else y

    def numpy_call():
        y = a @ w
        return y + bias if epilogue != "none" else y

    got = vm["main"](*args).numpy()
    err = float(np.max(np.abs(got - torch_call().numpy())))
    contenders = {"tvm": lambda: vm["main"](*args), "torch": torch_call, "numpy": numpy_call}
    times = {name: [] for name in contenders}
    for name, fn in contenders.items():
        fn()
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(_per_call_ms(fn, round_ms))
    flops = 2.0 * m * n * k
    best = {name: min(t) for name, t in times.items()}
    return {"shape": f"{m}x{k}x{n}", "max_abs_err": err, **{f"{n_}_ms": v for n_, v in best.items()},
            **{f"{n_}_gflops": flops / v / 1e6 for n_, v in best.items()},
            "tvm/torch": best["torch"] / best["tvm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["6272x96x384", "6272x384x96"], help="MxKxN")
    parser.add_argument("--epilogue", choices=["none", "bias", "gelu"], default="none")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-ms", type=float, default=300.0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("TVM_NUM_THREADS", os.cpu_count())))
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        result = measure(m, k, n, args.epilogue, args.rounds, args.round_ms)
        print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}" for key, val in result.items()))


if __name__ == "__main__":
    main()
