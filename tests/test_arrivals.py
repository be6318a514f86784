"""Arrival counters (schedules/cuda/arrivals): blocks of one launch whose last ones combine the partials of all.

A row-sum kernel, 8 blocks of 4 threads: each block writes its 4 partials,
the last arrival adds all 32 and resets the counters. Run under the SIMT
checker's OpenCL build on pocl and Oclgrind (twice, on new buffers), and
built for sm_90 with nvcc. Variants that break the protocol must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

import tvm_stitch  # noqa: F401  (imports the pass before schedules: the package's order)
from schedules.cuda import arrivals
from tvm_stitch.simt import opencl_run
from tvm_stitch.simt.opencl_build import build_opencl
from tvm_stitch.tools.launches import cuda_source

from conftest import needs_nvcc, nvcc, opencl_device

BLOCKS, THREADS, COLUMNS = 8, 4, 64


def _kernel(reset: bool = True, combine_after_ticket: bool = True, name: str = "row_sum"):
    """`combine_after_ticket=False`: block 0 combines at once, neither last nor waiting."""
    last = BLOCKS - 1 if combine_after_ticket else -1

    @T.prim_func
    def row_sum(x: T.Buffer((BLOCKS, COLUMNS), "float32"), partials: T.Buffer((BLOCKS * THREADS,), "float32"),
                out: T.Buffer((1,), "float32")):
        T.func_attr({"tirx.noalias": True, "global_symbol": name, "tirx.is_scheduled": True})
        for b in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            turn = T.decl_buffer((1,), "int32", scope="shared")
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), "float32", scope="local")
                mine = T.decl_buffer((1,), "int32", scope="local")
                acc[0] = T.float32(0)
                for i in range(COLUMNS // THREADS):
                    acc[0] = acc[0] + x[b, i * THREADS + t]
                partials[b * THREADS + t] = acc[0]
                T.evaluate(arrivals.fence())
                T.tvm_storage_sync("shared")
                if t == 0:
                    turn[0] = arrivals.ticket(0)
                T.tvm_storage_sync("shared")
                mine[0] = turn[0]
                if mine[0] == last or (not combine_after_ticket and b == 0 and t == 0):
                    if t == 0:
                        if combine_after_ticket:
                            T.evaluate(arrivals.await_arrivals(0, BLOCKS))
                        acc[0] = T.float32(0)
                        for j in range(BLOCKS * THREADS):
                            acc[0] = acc[0] + partials[j]
                        out[0] = acc[0]
                        if reset:
                            if arrivals.ticket(1) == 0:
                                T.evaluate(arrivals.reset(0))
                                T.evaluate(arrivals.reset(1))

    return row_sum


def _run(func, oclgrind: bool):
    x = np.random.default_rng(0).standard_normal((BLOCKS, COLUMNS)).astype("float32")
    specs = [("x", "float32", (BLOCKS, COLUMNS)), ("partials", "float32", (BLOCKS * THREADS,)),
             ("out", "float32", (1,))]
    return x, opencl_run.run(build_opencl(func, "row_sum"), specs, {0: x}, opencl_device(oclgrind), oclgrind)


@pytest.mark.parametrize("oclgrind", [False, True], ids=["pocl", "oclgrind"])
def test_last_arrival_combines_every_block_and_leaves_the_counters_at_zero(oclgrind):
    x, result = _run(_kernel(), oclgrind)
    assert result.guard_problems == [] and result.findings == []
    np.testing.assert_allclose(result.outputs[2][0], x.astype("float64").sum(), rtol=1e-5)


def test_counters_left_set_fail_the_second_run():
    _, result = _run(_kernel(reset=False), False)
    assert any("arrival counters" in p for p in result.guard_problems)


def test_a_combine_not_ordered_by_the_ticket_is_a_race_under_oclgrind():
    _, result = _run(_kernel(combine_after_ticket=False), True)
    assert any(f.status == "race" for f in result.findings)


@needs_nvcc
def test_cuda_build_defines_the_counters_once_per_module(tmp_path):
    mod = tvm.IRModule({"f": _kernel(name="f"), "g": _kernel(name="g")})
    lib = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm"))
    source = cuda_source(lib)
    assert source.count(f"counters[{arrivals.SLOTS}]") == 1
    nvcc(source, tmp_path, ptx=True)
    assert (tmp_path / "kernels.ptx").read_text().count("atom.global.add.u32") == 4  # 2 tickets per kernel
    assert "0 bytes spill stores" in nvcc(source, tmp_path)
