"""Fitted time-model constants per CUDA arch, shipped as JSON in planning/time_fits/<arch>.json.

`tvm-stitch calibrate RECORDS --write` fits the constants on kernels timed on a GPU
(tools/calibrate.py) and writes the arch's file; the spec (spec.py) takes a fitted
constant over the published figure for that arch. A file:

    {"arch": "sm_90", "constants": {"hbm_bytes_per_us": ..., "dram_latency_us": ...,
     "launch_us": ..., "sfu_per_sm_us": ...}, "records": 212, "error": {...}, "device": "..."}

Only the keys of FITTED are read; a file that does not parse is ignored (published figures).
The shipped files are read once, when this module is imported (read-only).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

FITS = Path(__file__).resolve().parent / "time_fits"  # the shipped tables (package data)
FITTED = ("hbm_bytes_per_us", "dram_latency_us", "launch_us", "sfu_per_sm_us")


def fit_path(arch: str, folder: Path = FITS) -> Path:
    return Path(folder) / f"{arch}.json"


def load_fit(arch: str, folder: Path = FITS) -> dict:
    """The fitted constants of `arch` in `folder` ({} where there is no usable file)."""
    path = fit_path(arch, folder)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        constants = data["constants"]
        return {key: float(constants[key]) for key in FITTED if key in constants and float(constants[key]) > 0}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _shipped() -> MappingProxyType:
    fits = {path.stem: load_fit(path.stem) for path in sorted(FITS.glob("*.json"))}
    return MappingProxyType({arch: MappingProxyType(c) for arch, c in fits.items() if c})


SHIPPED = _shipped()  # arch -> fitted constants


def fitted_constants(arch: str) -> dict:
    """The shipped fitted constants of a CUDA arch (e.g. "sm_90"; "sm_90a" reads sm_90's)."""
    return dict(SHIPPED.get(arch) or SHIPPED.get(arch.rstrip("abcdefghijklmnopqrstuvwxyz"), {}))
