"""TIR as text, edited and parsed again: test material for kernels run under the SIMT checker (light to
import: no tensor intrinsics registered)."""

from __future__ import annotations

import dataclasses
import re

import tvm

from tvm_stitch.simt import mma_emulation, narrow_floats, opencl_run
from tvm_stitch.simt.opencl_build import build_opencl
from tvm_stitch.simt.simt_inputs import concrete_shape


def with_static_shared(func):
    """`func` with its dynamic shared memory (`shared.dyn`) declared static (`shared`): the SIMT checker's
    launch geometry takes static shared memory only."""
    return reparsed(func.script().replace('"shared.dyn"', '"shared"'))


def reparsed(text: str):
    # TVMScript prints mma_fill/mma_store without the dtype its parser requires (float32 accumulators here)
    text = re.sub(r"(T\.cuda\.mma_(?:fill|store)_legacy\(.*)\)$", r'\1, dtype="float32")', text, flags=re.M)
    return tvm.script.from_source(text)


def run_on_pocl(func, inputs: dict):
    """A tensorized PrimFunc (static shared memory) run on pocl with its ldmatrix and mma emulated lane by
    lane and its half-precision floats widened: opencl_run's result for `inputs` (param index -> array)."""
    from conftest import opencl_device

    device_func = narrow_floats.widen(mma_emulation.lane_calls(func))
    program = build_opencl(device_func, "gemm")
    program = dataclasses.replace(program, source=narrow_floats.HELPERS + program.source)
    specs = [(str(p.name), "float32", concrete_shape(p)) for p in device_func.params]
    return opencl_run.run(program, specs, inputs, opencl_device(False), False)
