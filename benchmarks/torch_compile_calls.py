"""One model's forward under torch.compile: Inductor against backend="tvm_stitch", call by call.

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python benchmarks/torch_compile_calls.py convnext --calls 150

The two compiled forwards run alternately, one call each, the order flipped
every other pair, so both see the same load on a shared machine; printed:
each one's minimum and median ms per call and Inductor's time over
tvm_stitch's at the 10th, 25th and 50th percentiles and in the mean (above 1:
tvm_stitch is faster). `tvm_stitch torch-compile` times rounds of many calls
instead, whose medians swing with the load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model of tvm_stitch/tools/models.py")
    parser.add_argument("--size", default="cpu")
    parser.add_argument("--calls", type=int, default=150)
    args = parser.parse_args()
    import torch

    import tvm_stitch.torch  # noqa: F401 - registers the backend
    from tvm_stitch.tools.models import make_model

    torch.set_num_threads(1)
    model, inputs = make_model(args.model, args.size)
    calls = {}
    with torch.no_grad():
        want = model(*inputs)
        want = want if torch.is_tensor(want) else want[0]
        for backend in ("inductor", "tvm_stitch"):
            compiled = torch.compile(model, backend=backend)
            got = compiled(*inputs)
            got = got if torch.is_tensor(got) else got[0]
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            calls[backend] = lambda compiled=compiled: compiled(*inputs)
        times = {name: [] for name in calls}
        for fn in calls.values():
            fn()
        for i in range(args.calls):
            for name, fn in (list(calls.items()) if i % 2 else list(calls.items())[::-1]):
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
    ind, tvs = np.array(times["inductor"]), np.array(times["tvm_stitch"])
    ratios = " ".join(f"p{q} {np.percentile(ind, q) / np.percentile(tvs, q):.3f}" for q in (10, 25, 50))
    print(f"{args.model} forward, {args.calls} calls each: inductor min {ind.min():.2f} median {np.median(ind):.2f} ms, "
          f"tvm_stitch min {tvs.min():.2f} median {np.median(tvs):.2f} ms; inductor / tvm_stitch: {ratios}, "
          f"mean {ind.mean() / tvs.mean():.3f}")


if __name__ == "__main__":
    main()
