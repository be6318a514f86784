"""One stitched kernel run with SIMT semantics and compared with its unscheduled PrimFunc on llvm.

The scheduled PrimFunc (as built for CUDA) is lowered for OpenCL
(opencl_build), launched on pocl or Oclgrind (opencl_run) on seeded
inputs (simt_inputs), and every output is compared with the same
computation unscheduled — the fused PrimFunc(s) it was scheduled from —
built for llvm. A packed kernel (independent kernels in one launch) is
compared member by member. The status says what went wrong first: the
OpenCL build (`unsupported`), a guard-zone or Oclgrind finding
(`out-of-bounds`, `race`, `uninitialised`), then the numbers (`mismatch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import tvm
from tvm import tirx

from tvm_stitch.check import narrow_floats, opencl_run
from tvm_stitch.check.opencl_build import build_opencl
from tvm_stitch.check.simt_inputs import numpy_dtype, random_inputs, written_params

FINDING_ORDER = ("out-of-bounds", "race", "uninitialised", "unsupported")


@dataclass(frozen=True)
class KernelCheck:
    name: str
    status: str  # ok | mismatch | race | out-of-bounds | uninitialised | unsupported
    max_error: float  # largest |simt - reference| over finite elements (nan when nothing was compared)
    detail: str
    launches: int = 0

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


def _param_specs(func: tirx.PrimFunc) -> list:
    return [(str(p.name), str(p.ty.dtype), tuple(int(d) for d in p.ty.shape)) for p in func.params]


def _run_reference(ref: Reference, arrays: dict) -> dict:
    """Scheduled-parameter index -> output array, from the fused PrimFunc built for llvm."""
    func = ref.func.with_attr("global_symbol", "reference")
    lib = tvm.tirx.build(tvm.IRModule({"reference": func}), target="llvm")
    dev = tvm.cpu()
    outputs = set(written_params(ref.func))
    args = []
    for k, ((_, dtype, shape), index) in enumerate(zip(_param_specs(ref.func), ref.params)):
        if k in outputs:
            args.append(tvm.runtime.empty(shape, dtype, dev))
        else:
            args.append(tvm.runtime.tensor(arrays[index], dev))
    lib["reference"](*args)
    return {ref.params[k]: args[k].numpy() for k in outputs}


def _references(refs: list, arrays: dict) -> dict:
    out = {}
    for ref in refs:
        out.update(_run_reference(ref, arrays))
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


def check_kernel(name: str, scheduled: tirx.PrimFunc, refs: list, device, oclgrind: bool, seed: int) -> KernelCheck:
    """Build, run and compare one stitched PrimFunc; never raises for a kernel's own failure."""
    symbolic = [str(p.name) for p in scheduled.params if not all(isinstance(d, tirx.IntImm) for d in p.ty.shape)]
    if symbolic:
        return KernelCheck(name, "unsupported", float("nan"),
                           f"symbolic shapes ({', '.join(symbolic)}): the checker runs static shapes; "
                           "check the graph at concrete sizes")
    notes = []
    device_func = scheduled
    narrow = narrow_floats.narrow_types(scheduled)
    emulate = "bfloat16" in narrow or ("float16" in narrow and "cl_khr_fp16" not in device.extensions)
    try:
        if emulate:
            device_func = narrow_floats.widen(scheduled)
            notes.append(f"{'/'.join(sorted(narrow))} emulated: float32 storage rounded after every op "
                         "(the device has no such type)")
        program = build_opencl(device_func, name)
    except Exception as err:  # noqa: BLE001 - a kernel OpenCL cannot express is reported, not raised
        return KernelCheck(name, "unsupported", float("nan"), f"OpenCL build failed: {_last_line(err)}")
    if emulate:
        program = dataclasses.replace(program, source=narrow_floats.HELPERS + program.source)
    launches = len(program.plan.launches)
    try:
        arrays = random_inputs(scheduled, seed)
        want = _references(refs, arrays)
        if any(not np.all(np.isfinite(w.astype(np.float64))) for w in want.values()):
            arrays = random_inputs(scheduled, seed, positive=True)  # log, sqrt, power of negatives
            want = _references(refs, arrays)
    except Exception as err:  # noqa: BLE001 - no reference, nothing to compare with
        return KernelCheck(name, "unsupported", float("nan"), f"llvm reference failed: {_last_line(err)}", launches)
    specs = _param_specs(device_func)
    device_arrays = {i: a.astype(numpy_dtype(specs[i][1])) for i, a in arrays.items()}
    try:
        result = opencl_run.run(program, specs, device_arrays, device, oclgrind)
    except Exception as err:  # noqa: BLE001 - e.g. the OpenCL compiler rejects TVM's source
        return KernelCheck(name, "unsupported", float("nan"), f"OpenCL run failed: {_last_line(err)}", launches)
    if "red_buf" in program.source:
        notes.append("cross-thread reductions ran as local-memory trees (CUDA uses warp shuffles)")
    max_error, bad, total = float("nan"), 0, 0
    for index, expected in want.items():
        got = result.outputs[index].astype(expected.dtype)
        # A value that went through float16/bfloat16 inside the kernel carries that type's error (and
        # TVM's llvm lowering drops a float32 -> bfloat16 -> float32 round trip that CUDA keeps).
        dtype = next((n for n in narrow_floats.NARROW if n in narrow), str(scheduled.params[index].ty.dtype))
        err, wrong = compare(got, expected, dtype)
        max_error = err if np.isnan(max_error) else max(max_error, err)
        bad += wrong
        total += expected.size
    notes.extend(result.notes)
    findings = [(f.status, f"{f.headline} ({f.count}x) {f.where}".strip()) for f in result.findings]
    findings += [("out-of-bounds", problem) for problem in result.guard_problems]
    findings.sort(key=lambda item: FINDING_ORDER.index(item[0]))
    if findings:
        status = findings[0][0]
        detail = "; ".join(text for _, text in findings[:3])
    elif bad:
        status, detail = "mismatch", f"{bad} of {total} output elements out of tolerance"
    else:
        status, detail = "ok", f"{total} output elements match"
    return KernelCheck(name, status, max_error, "; ".join([detail] + notes), launches)


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip(" ^~\t")]
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"
