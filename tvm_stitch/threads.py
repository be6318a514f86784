"""CPU threads: `TVM_NUM_THREADS` when set, otherwise every core of the machine.

Left alone, TVM's runtime starts half of the logical CPUs (it assumes two
hardware threads per core): on a 2-vCPU machine it ran stitched kernels on
one thread while PyTorch used two. Importing tvm_stitch sets
`TVM_NUM_THREADS` to the CPUs the process may use unless the user set it; the
runtime reads it when its thread pool first starts.
"""

from __future__ import annotations

import os

import tvm


def machine_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else every CPU)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def use_all_cores() -> None:
    """Default `TVM_NUM_THREADS` to the machine's CPU count (a value the user set stays)."""
    env = os.environ.get("TVM_NUM_THREADS", "")
    if not (env.isdigit() and int(env) > 0):
        os.environ["TVM_NUM_THREADS"] = str(machine_cores())


def cpu_threads() -> int:
    """Threads TVM's runtime runs a parallel loop on."""
    return int(tvm.get_global_func("runtime.NumThreads")())
