"""Compile seconds of a lone symbolic softmax on sm_90 with its size variants and with the plan for every
size only (the size-variant step left out), in alternating rounds in one process after one warm-up build of
each: medians of wall and CPU (process) seconds and their ratios. Run from the repository root.

Usage: python benchmarks/variant_compile_times.py [--device-code nvcc|nvrtc] ROUNDS CASE...
(CASE: n32, m30000, n768)

Without a GPU driver TVM's CUDA build stops at CUDA source: the figures are the Relax and TIR pipelines and
code generation. `--device-code` measures the whole build a GPU machine runs, the device code compiled by
TVM's own hook (`tvm_callback_cuda_compile`, the given TVM_CUDA_COMPILE_MODE; nvrtc needs the cuda-bindings
and nvidia-cuda-nvrtc packages): the script runs itself again in a child whose `import tvm` loads TVM's CUDA
runtime through the stand-in driver of tools/device_code.py. Device compilation runs in nvcc or nvrtc, so the
wall seconds are the figures to read there.
"""

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import tvm
from tvm import tirx

from tvm_stitch.stitch import kernel_maker
from tvm_stitch.tools import device_code
from tvm_stitch.tools.build import build

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import symbolic_softmax  # noqa: E402

CUDA = {"kind": "cuda", "arch": "sm_90"}
N = tirx.Var("n", "int64")
CASES = {"n32": ((N, 32), 1 << 20), "m30000": ((N, 30000), 4096), "n768": ((N, 768), 128)}


def one_plan():
    """The stitch pass without its size-variant step: every kernel keeps the plan for every size."""
    return mock.patch.object(kernel_maker, "size_variants", lambda *_args: ())


def seconds(mod, variants: bool) -> tuple:
    """(wall, process) seconds of one build, in the target's scope (TVM's device-code hook reads the arch
    from it where the CUDA runtime is loaded)."""
    with contextlib.nullcontext() if variants else one_plan(), tvm.target.Target(CUDA):
        wall, cpu = time.perf_counter(), time.process_time()
        build(mod, CUDA, stitched=True)
        return time.perf_counter() - wall, time.process_time() - cpu


def main(rounds: str, *cases: str) -> None:
    code = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc") if device_code.cuda_runtime_loaded() else "none"
    for name in cases:
        shape, upper = CASES[name]
        mod = symbolic_softmax(shape, (1, upper))
        seconds(mod, True), seconds(mod, False)
        times = {False: [], True: []}
        for k in range(int(rounds)):
            for variants in (False, True) if k % 2 == 0 else (True, False):
                times[variants].append(seconds(mod, variants))
        one, var = ([statistics.median(t[i] for t in times[v]) for i in (0, 1)] for v in (False, True))
        print(f"{name} device code {code} | wall one {one[0]:.3f} var {var[0]:.3f} ratio {var[0] / one[0]:.2f} | "
              f"process one {one[1]:.3f} var {var[1]:.3f} ratio {var[1] / one[1]:.2f} | "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


def with_device_code(compiler: str, args: list) -> int:
    """Run this script again with TVM's CUDA runtime loaded (the stand-in driver) and `compiler`."""
    with tempfile.TemporaryDirectory(prefix="tvm-stitch-driver-") as driver:
        device_code.write_standin_driver(driver)
        env = dict(os.environ, TVM_CUDA_COMPILE_MODE=compiler,
                   LD_LIBRARY_PATH=os.pathsep.join(p for p in (driver, os.environ.get("LD_LIBRARY_PATH", "")) if p))
        return subprocess.run([sys.executable, __file__, *args], env=env, check=False).returncode


if __name__ == "__main__":
    if sys.argv[1] == "--device-code":
        sys.exit(with_device_code(sys.argv[2], sys.argv[3:]))
    main(*sys.argv[1:])
