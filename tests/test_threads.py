"""tvm_stitch runs parallel loops on every core unless TVM_NUM_THREADS says otherwise."""

import os
import subprocess
import sys


def _runtime_threads(env: dict) -> int:
    code = "import tvm_stitch, tvm; print(tvm.get_global_func('runtime.NumThreads')())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_default_is_every_core():
    from tvm_stitch.threads import machine_cores

    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    assert _runtime_threads(env) == machine_cores() == len(os.sched_getaffinity(0))


def test_tvm_num_threads_is_respected():
    assert _runtime_threads({**os.environ, "TVM_NUM_THREADS": "1"}) == 1
