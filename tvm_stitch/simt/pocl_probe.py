"""Finding a pocl that compiles kernels on this processor.

The pocl inside pyopencl's wheel (pocl 3.0, LLVM 14) compiles no kernel on a
processor newer than its LLVM (AMD Zen 5, for one): LLVM names the host CPU
"generic", pocl passes that name to clang as -target-cpu, and every build
fails with "unknown target CPU 'generic'". Debian's pocl ties its kernel
library to a CPU its LLVM knows and runs there; pyopencl's ICD loader lists
it beside the wheel's own pocl once it is installed (apt-get install
pocl-opencl-icd puts /etc/OpenCL/vendors/pocl.icd). Each pocl device is
probed with a trivial kernel, built and run, once per process, and the first
that runs it is used.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

SYSTEM_VENDORS = "/etc/OpenCL/vendors"
PROBE_SOURCE = "__kernel void probe(__global float *a) { a[get_global_id(0)] += 1.0f; }"
UNKNOWN_CPU = "unknown target CPU"


@functools.cache
def build_problem(device) -> str:
    """'' when `device` builds and runs a trivial kernel correctly, else what went wrong."""
    import pyopencl as cl

    try:
        ctx = cl.Context([device])
        queue = cl.CommandQueue(ctx)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cl.CompilerWarning)
            program = cl.Program(ctx, PROBE_SOURCE).build()
        data = np.zeros(4, dtype=np.float32)
        buffer = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=data)
        program.probe(queue, data.shape, None, buffer)
        cl.enqueue_copy(queue, data, buffer)
        queue.finish()
    except (cl.Error, RuntimeError) as err:
        return _error_line(str(err))
    return "" if np.all(data == 1.0) else f"a trivial kernel computed {data.tolist()} instead of all 1.0"


def _error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return (errors or lines or ["unknown error"])[0][:300]


def unusable_message(problems: list) -> str:
    """Why no pocl device can be used; `problems`: (platform version, build_problem) per pocl platform."""
    found = "; ".join(f"{version}: {problem}" for version, problem in problems)
    cause = ""
    if any(UNKNOWN_CPU in problem for _, problem in problems):
        cause = (" Its LLVM does not know this processor, names it 'generic' and pocl passes that to clang"
                 " as the target CPU.")
    return (f"pocl cannot run kernels on this machine ({found}).{cause} Debian's pocl runs on such"
            f" processors: apt-get install pocl-opencl-icd (pyopencl finds it through {SYSTEM_VENDORS}).")
