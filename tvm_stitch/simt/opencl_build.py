"""A scheduled PrimFunc built with TVM's OpenCL code generator: the OpenCL C source and its launches.

The PrimFunc is the one the CUDA target gets (thread bindings, shared and
local scopes); only the code generator differs. TVM's TIR pipeline for the
OpenCL target inserts the barriers and lowers cross-thread reductions as it
does for CUDA, except that OpenCL has no warp shuffles (its warp size is 1):
reductions become local-memory trees. The source is text; nothing runs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods

from tvm_stitch.simt.arrivals_opencl import arrivals_as_extern_calls, with_helper
from tvm_stitch.simt.launch_geometry import LaunchPlan, launch_plan
from tvm_stitch.simt.mma_emulation import with_exchange
from tvm_stitch.simt.opencl_semantics import (bool_casts_as_selects, cuda_atomics_as_opencl,
                                               emulated_atomics_read_atomically, libm_names_as_builtins,
                                               tan_as_sin_over_cos)

OPENCL = Target({"kind": "opencl"}, host="llvm")


@dataclass(frozen=True)
class OpenclProgram:
    source: str
    plan: LaunchPlan
    kernel_params: dict  # kernel name -> tuple of parameter dtypes ("handle" for pointers)


def build_opencl(func: tirx.PrimFunc, name: str = "simt") -> OpenclProgram:
    """Lower `func` for OpenCL (raises what TVM raises when it cannot)."""
    func = arrivals_as_extern_calls(cuda_atomics_as_opencl(tan_as_sin_over_cos(bool_casts_as_selects(func))))
    func = func.with_attr("global_symbol", name)
    params = list(func.params)
    mod = tvm.tirx.transform.BindTarget(OPENCL)(tvm.IRModule({name: func}))
    pipeline, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(OPENCL)
    mod = pipeline(mod)
    host_mod, device_mods = split_host_device_mods(mod)
    hosts = [f for _, f in host_mod.functions_items()]
    if len(hosts) != 1 or len(device_mods) != 1:
        raise ValueError(f"expected one host function and one device module, got {len(hosts)} and {len(device_mods)}")
    (device_target, device_mod), = device_mods.items()
    device_mod = finalize_device()(device_mod)
    kernel_params = {
        gv.name_hint: tuple(str(p.ty.dtype) if hasattr(p.ty, "dtype") else "handle" for p in f.params)
        for gv, f in device_mod.functions_items()
    }
    source = with_helper(emulated_atomics_read_atomically(libm_names_as_builtins(
        tvm.get_global_func("target.build.opencl")(device_mod, device_target).inspect_source(""))))
    plan = launch_plan(hosts[0], params, {k: len(v) for k, v in kernel_params.items()})
    return OpenclProgram(with_exchange(source, plan), plan, kernel_params)
