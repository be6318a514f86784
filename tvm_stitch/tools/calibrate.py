"""Fitting the CUDA time model's constants to kernels timed on a GPU (`tvm-stitch calibrate RECORDS`).

A record (JSON lines; the GPU kit's runner writes calibration.jsonl) is one
PrimFunc measured on one device:

    {"arch": "sm_90", "device": "NVIDIA H200", "name": "stitch_0_...", "kernels": [geometry, ...],
     "modeled_us": 8.8, "measured_us": 9.6}

`kernels`: the KernelGeometry of each of its launches (`dataclasses.asdict`),
`measured_us`: the device time of one call. The fit (scipy's least squares,
on the logarithms of the constants and of modeled over measured time, so
that a 10% error weighs alike on small and large kernels) finds the
constants of time_fit.FITTED for the arch, starting from the spec's; the
model's error is printed before and after. `--write` stores the fit in
planning/time_fits/<arch>.json (or `--out`), which the spec then loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_fit import FITTED, fit_path
from tvm_stitch.planning.time_model import geometry_from_dict, kernel_time


def read_records(path: str) -> list:
    """The records of a JSON-lines file (blank lines skipped); ValueError naming a bad line."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["geometries"] = [geometry_from_dict(g) for g in record["kernels"]]
            if not float(record["measured_us"]) > 0:
                raise ValueError("measured_us must be positive")
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not a calibration record ({type(err).__name__}: {err})") from err
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def predicted_us(record: dict, spec: TargetSpec) -> float:
    return sum(kernel_time(g, spec).us for g in record["geometries"])


def errors(records: list, spec: TargetSpec) -> dict:
    """The model's error on the records: median and worst |modeled / measured - 1|, RMS of the log ratio."""
    ratios = np.array([predicted_us(r, spec) / float(r["measured_us"]) for r in records])
    relative = np.abs(ratios - 1)
    return {"records": len(records), "median": float(np.median(relative)), "worst": float(relative.max()),
            "rms_log": float(np.sqrt(np.mean(np.log(ratios) ** 2)))}


def fit(records: list, spec: TargetSpec) -> tuple:
    """(the spec with the fitted constants, {constant: fitted value}) for the records of one arch."""
    from scipy.optimize import least_squares

    start = np.log([getattr(spec, key) for key in FITTED])
    measured = np.log([float(r["measured_us"]) for r in records])

    def with_constants(logs) -> TargetSpec:
        return dataclasses.replace(spec, **{key: float(math.exp(v)) for key, v in zip(FITTED, logs)})

    def residuals(logs):
        fitted = with_constants(logs)
        return np.log([predicted_us(r, fitted) for r in records]) - measured

    # The model is piecewise smooth (a maximum per wave): finite differences over steps of ~5%.
    result = least_squares(residuals, start, diff_step=0.05, bounds=(start - 3.0, start + 3.0), loss="soft_l1",
                           f_scale=0.1, xtol=1e-10, ftol=1e-12, max_nfev=2000)
    fitted = with_constants(result.x)
    return fitted, {key: getattr(fitted, key) for key in FITTED}


def calibrate(path: str, arch: str = "", write: bool = False, out: str = "") -> str:
    """Fit the records of `arch` (default: the records' only arch) and describe the fit; with
    `write`, store it where the spec loads it (`out`: another file)."""
    from tvm.target import Target

    records = read_records(path)
    arches = sorted({r.get("arch", "") for r in records})
    if not arch:
        if len(arches) != 1:
            raise ValueError(f"records of several arches ({', '.join(arches)}): name one with --arch")
        arch = arches[0]
    records = [r for r in records if r.get("arch", "") == arch]
    if not records:
        raise ValueError(f"no records for {arch} (the records have {', '.join(arches)})")
    spec = TargetSpec.from_target(Target({"kind": "cuda", "arch": arch}))
    before = errors(records, spec)
    fitted, constants = fit(records, spec)
    after = errors(records, fitted)
    lines = [f"{len(records)} records of {arch} ({', '.join(sorted({r.get('device', '?') for r in records}))})",
             "constant            spec        fitted"]
    lines += [f"{key:18s} {getattr(spec, key):10.4g}  {value:10.4g}" for key, value in constants.items()]
    for what, err in (("spec", before), ("fitted", after)):
        lines.append(f"model error with the {what} constants: median {err['median']:.1%}, worst {err['worst']:.1%}, "
                     f"RMS log ratio {err['rms_log']:.3f}")
    if write:
        target = Path(out) if out else fit_path(arch)
        target.parent.mkdir(parents=True, exist_ok=True)
        devices = sorted({r.get("device", "") for r in records})
        target.write_text(json.dumps({"arch": arch, "constants": constants, "records": len(records),
                                      "error": after, "error_with_spec": before, "device": ", ".join(devices)},
                                     indent=1) + "\n", encoding="utf-8")
        lines.append(f"wrote {target}")
    return "\n".join(lines)
