"""One stitched kernel run with SIMT semantics and compared with its unscheduled PrimFunc on llvm.

The scheduled PrimFunc (as built for CUDA) is lowered for OpenCL
(opencl_build), launched on pocl or Oclgrind (opencl_run) on seeded
inputs (simt_inputs), and every output is compared with the same
computation unscheduled — the fused PrimFunc(s) it was scheduled from —
built for llvm. A packed kernel (independent kernels in one launch) is
compared member by member. The status says what went wrong first: the
OpenCL build (`unsupported`), a guard-zone or Oclgrind finding
(`out-of-bounds`, `race`, `uninitialised`), then the numbers (`mismatch`).

A kernel of symbolic shape is the symbolic kernel itself: its OpenCL
source is generated once, its shape variables are scalar arguments, and it
is launched at a few sizes (symbolic_sizes) with the grid its host code
computes from them; the llvm reference, also built once, runs at each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import tvm
from tvm import tirx

from tvm_stitch.simt import mma_emulation, narrow_floats, opencl_run
from tvm_stitch.simt.launch_geometry import UnsupportedLaunch
from tvm_stitch.simt.opencl_build import build_opencl
from tvm_stitch.simt.simt_inputs import concrete_shape, numpy_dtype, random_inputs, written_params
from tvm_stitch.simt.symbolic_sizes import concrete, describe, size_points

FINDING_ORDER = ("out-of-bounds", "race", "uninitialised", "unsupported")


@dataclass(frozen=True)
class KernelCheck:
    name: str
    status: str  # ok | mismatch | race | out-of-bounds | uninitialised | unsupported
    max_error: float  # largest |simt - reference| over finite elements (nan when nothing was compared)
    detail: str
    launches: int = 0
    sizes: tuple = ()  # the sizes a symbolic kernel ran at ("n=37, s=5" each); () for a static one

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def tolerance(dtype: str) -> tuple:
    """(rtol, atol): the square root of the dtype's machine epsilon, for both.

    The two builds differ only in the order of reductions and in the math
    library (OpenCL's exp vs LLVM's), errors of a few ulps per op that grow
    with the length of a reduction; sqrt(eps) (3e-4 for float32, 3e-2 for
    float16) leaves room for those and catches any wrong element.
    """
    np_type = numpy_dtype(dtype)
    eps = float(ml_dtypes.finfo(np_type).eps) if np.issubdtype(np_type, np.inexact) or dtype == "bfloat16" else 0.0
    return eps ** 0.5, eps ** 0.5


@dataclass(frozen=True)
class Reference:
    """A fused (unscheduled) PrimFunc and, per its parameter, the scheduled kernel's parameter index."""

    func: tirx.PrimFunc
    params: tuple


def _param_specs(func: tirx.PrimFunc, point: dict) -> list:
    """(name, dtype, shape at `point`) per parameter; shape None for a scalar parameter."""
    return [(str(p.name), str(p.ty.dtype), concrete_shape(p, point) if isinstance(p.ty, tirx.BufferType) else None)
            for p in func.params]


def _build_reference(ref: Reference):
    """The fused PrimFunc built for llvm (once: its symbolic shapes are read from the arrays)."""
    func = ref.func.with_attr("global_symbol", "reference")
    return tvm.tirx.build(tvm.IRModule({"reference": func}), target="llvm")["reference"]


def _run_reference(ref: Reference, run, arrays: dict, specs: list, point: dict) -> dict:
    """Scheduled-parameter index -> output array; `specs`: the scheduled kernel's at `point`."""
    dev = tvm.cpu()
    outputs = set(written_params(ref.func))
    args = []
    for k, (param, index) in enumerate(zip(ref.func.params, ref.params)):
        if not isinstance(param.ty, tirx.BufferType):
            args.append(concrete(param, point))
        elif k in outputs:
            args.append(tvm.runtime.empty(specs[index][2], specs[index][1], dev))
        else:
            args.append(tvm.runtime.tensor(arrays[index], dev))
    run(*args)
    return {ref.params[k]: args[k].numpy() for k in outputs}


def _references(refs: list, runs: list, arrays: dict, specs: list, point: dict) -> dict:
    out = {}
    for ref, run in zip(refs, runs):
        out.update(_run_reference(ref, run, arrays, specs, point))
    return out


def compare(got: np.ndarray, want: np.ndarray, dtype: str) -> tuple:
    """(max abs error over finite elements, number of elements out of tolerance)."""
    rtol, atol = tolerance(dtype)
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    bad = int(np.count_nonzero(~finite & ~((np.isnan(w) & np.isnan(g)) | (w == g))))
    diff = np.abs(g[finite] - w[finite])
    bad += int(np.count_nonzero(~(diff <= atol + rtol * np.abs(w[finite]))))
    return (float(diff.max()) if diff.size else float("nan")), bad


@dataclass(frozen=True)
class _SizeCheck:
    """The outcome of one run of a kernel at one size."""

    status: str
    max_error: float
    detail: str
    elements: int = 0
    notes: tuple = ()


def check_kernel(name: str, scheduled: tirx.PrimFunc, refs: list, device, oclgrind: bool, seed: int,
                 points: list | None = None) -> KernelCheck:
    """Build, run and compare one stitched PrimFunc; never raises for a kernel's own failure.

    A kernel of symbolic shape is built once and run at every point of
    `points` ({symbolic variable name: value}; default symbolic_sizes'
    defaults); a failure at any size makes it not ok.
    """
    try:
        points = points if points is not None else size_points(scheduled, {}, {}, {})
    except ValueError as err:
        return KernelCheck(name, "unsupported", float("nan"), f"no sizes to check: {err}")
    notes = []
    device_func = scheduled
    narrow = narrow_floats.narrow_types(scheduled)
    tensor_cores = mma_emulation.has_tensor_core_calls(scheduled)  # emulated on float32 storage
    emulate = tensor_cores or "bfloat16" in narrow or ("float16" in narrow and "cl_khr_fp16" not in device.extensions)
    try:
        if tensor_cores:
            device_func = mma_emulation.lane_calls(device_func)
            notes.append("ldmatrix/mma emulated lane by lane in PTX's fragment layouts")
        if emulate:
            device_func = narrow_floats.widen(device_func)
            notes.append(f"{'/'.join(sorted(narrow))} emulated: float32 storage rounded after every op "
                         "(the device has no such type)")
        program = build_opencl(device_func, name)
    except Exception as err:  # noqa: BLE001 - a kernel OpenCL cannot express is reported, not raised
        return KernelCheck(name, "unsupported", float("nan"), f"OpenCL build failed: {_last_line(err)}")
    if emulate:
        program = dataclasses.replace(program, source=narrow_floats.HELPERS + program.source)
    if "red_buf" in program.source:
        notes.append("cross-thread reductions ran as local-memory trees (CUDA uses warp shuffles)")
    launches = len(program.plan.launches)
    try:
        runs = [_build_reference(ref) for ref in refs]
    except Exception as err:  # noqa: BLE001 - no reference, nothing to compare with
        return KernelCheck(name, "unsupported", float("nan"), f"llvm reference failed: {_last_line(err)}", launches)
    checks = [_check_at(point, scheduled, device_func, program, refs, runs, narrow, device, oclgrind, seed)
              for point in points]
    errors = [c.max_error for c in checks if not np.isnan(c.max_error)]
    max_error = max(errors) if errors else float("nan")
    sizes = [describe(p) for p in points]
    notes.extend(n for c in checks for n in c.notes if n not in notes)
    bad = next((k for k, c in enumerate(checks) if c.status != "ok"), None)
    if bad is None:
        detail = f"{sum(c.elements for c in checks)} output elements match"
        if any(sizes):
            detail += f" at {'; '.join(sizes)}"
        status = "ok"
    else:
        status, detail = checks[bad].status, checks[bad].detail
        if any(sizes):
            passed = [sizes[k] for k, c in enumerate(checks) if c.status == "ok"]
            detail = f"at {sizes[bad]}: {detail}" + (f" (ok at {'; '.join(passed)})" if passed else "")
    return KernelCheck(name, status, max_error, "; ".join([detail] + notes), launches,
                       tuple(s for s in sizes if s))


def _check_at(point: dict, scheduled, device_func, program, refs: list, runs: list, narrow: set, device,
              oclgrind: bool, seed: int) -> _SizeCheck:
    """One run of the built kernel at `point`, compared with its references."""
    nan = float("nan")
    try:
        specs = _param_specs(scheduled, point)
        device_specs = _param_specs(device_func, point)
        program = dataclasses.replace(program, plan=program.plan.at(point))
    except (ValueError, UnsupportedLaunch) as err:
        return _SizeCheck("unsupported", nan, f"no launch at this size: {err}")
    try:
        arrays = random_inputs(scheduled, seed, values=point)
        want = _references(refs, runs, arrays, specs, point)
        if any(not np.all(np.isfinite(w.astype(np.float64))) for w in want.values()):
            arrays = random_inputs(scheduled, seed, positive=True, values=point)  # log, sqrt, power of negatives
            want = _references(refs, runs, arrays, specs, point)
    except Exception as err:  # noqa: BLE001 - no reference, nothing to compare with
        return _SizeCheck("unsupported", nan, f"llvm reference failed: {_last_line(err)}")
    device_arrays = {i: a.astype(numpy_dtype(device_specs[i][1])) for i, a in arrays.items()}
    try:
        result = opencl_run.run(program, device_specs, device_arrays, device, oclgrind)
    except Exception as err:  # noqa: BLE001 - e.g. the OpenCL compiler rejects TVM's source
        return _SizeCheck("unsupported", nan, f"OpenCL run failed: {_last_line(err)}")
    max_error, bad, total = nan, 0, 0
    for index, expected in want.items():
        got = result.outputs[index].astype(expected.dtype)
        # A value that went through float16/bfloat16 inside the kernel carries that type's error (and
        # TVM's llvm lowering drops a float32 -> bfloat16 -> float32 round trip that CUDA keeps).
        dtype = next((n for n in narrow_floats.NARROW if n in narrow), str(scheduled.params[index].ty.dtype))
        err, wrong = compare(got, expected, dtype)
        max_error = err if np.isnan(max_error) else max(max_error, err)
        bad += wrong
        total += expected.size
    findings = [(f.status, f"{f.headline} ({f.count}x) {f.where}".strip()) for f in result.findings]
    findings += [("out-of-bounds", problem) for problem in result.guard_problems]
    findings.sort(key=lambda item: FINDING_ORDER.index(item[0]))
    if findings:
        return _SizeCheck(findings[0][0], max_error, "; ".join(text for _, text in findings[:3]), total,
                          tuple(result.notes))
    if bad:
        return _SizeCheck("mismatch", max_error, f"{bad} of {total} output elements out of tolerance", total,
                          tuple(result.notes))
    return _SizeCheck("ok", max_error, "", total, tuple(result.notes))


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip(" ^~\t")]
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"
