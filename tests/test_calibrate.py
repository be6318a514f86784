"""Calibration of the time model recovers known constants from records made with them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import CUDA
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_fit import FITTED, load_fit
from tvm_stitch.planning.time_model import KernelGeometry, kernel_time
from tvm_stitch.tools.calibrate import calibrate, errors, fit, read_records
from tvm_stitch.tools.cli import main

SPEC = TargetSpec.from_target(CUDA)
# The "device": every constant off the published figure.
TRUE = dataclasses.replace(SPEC, hbm_bytes_per_us=0.8 * SPEC.hbm_bytes_per_us,
                           dram_latency_us=1.3 * SPEC.dram_latency_us, launch_us=2.2,
                           sfu_per_sm_us=0.6 * SPEC.sfu_per_sm_us)


def _geometries() -> list:
    """Kernels bound by each part: launches, bandwidth, latency, special functions, and mixtures."""
    out = []
    for grid in (1, 8, 64):
        out.append(KernelGeometry("tiny", grid, 64, loads=((4, 1),), stores=((4, 1),), load_sites=1, load_phases=1))
    for blocks in (20000, 65536, 300000):
        out.append(KernelGeometry("copy", blocks, 256, loads=((16, 1),), stores=((16, 1),), load_sites=1,
                                  load_phases=1))
    for loads in (256, 1024, 4096):
        out.append(KernelGeometry("walk", 32, 32, loads=((4, loads),), stores=((4, 1),), load_sites=4,
                                  load_phases=1, serial_iterations=loads))
    for sfu in (16.0, 64.0, 128.0):
        out.append(KernelGeometry("exp", 30000, 256, loads=((16, 1),), stores=((16, 1),), load_sites=1,
                                  load_phases=1, sfu_ops=sfu))
    out.append(KernelGeometry("mixed", 4096, 192, loads=((16, 2), (4, 1)), stores=((16, 1),), load_sites=3,
                              load_phases=2, barriers=6, sfu_ops=4.0))
    return out


def _write(path, spec: TargetSpec, arch: str = "sm_90") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for g in _geometries():
            measured = kernel_time(g, spec).us
            f.write(json.dumps({"arch": arch, "device": "synthetic", "name": g.name,
                                "kernels": [dataclasses.asdict(g)], "modeled_us": kernel_time(g, SPEC).us,
                                "measured_us": measured}) + "\n")


def test_the_fit_recovers_the_constants_the_records_were_made_with(tmp_path):
    path = tmp_path / "records.jsonl"
    _write(path, TRUE)
    records = read_records(str(path))
    assert errors(records, SPEC)["worst"] > 0.2  # the published constants are off on this "device"
    fitted, constants = fit(records, SPEC)
    for key in FITTED:
        assert constants[key] == pytest.approx(getattr(TRUE, key), rel=0.03), key
    assert errors(records, fitted)["worst"] < 0.02


def test_calibrate_prints_the_error_and_writes_a_table_the_spec_loads(tmp_path, capsys):
    path, out = tmp_path / "records.jsonl", tmp_path / "fits" / "sm_90.json"
    _write(path, TRUE)
    assert main(["calibrate", str(path), "--write", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model error with the spec constants" in text and "model error with the fitted constants" in text
    assert load_fit("sm_90", out.parent)["launch_us"] == pytest.approx(2.2, rel=0.03)


def test_bad_records_are_refused_with_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arch": "sm_90", "kernels": [], "measured_us": 0}\n')
    assert main(["calibrate", str(path)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    mixed = tmp_path / "mixed.jsonl"
    _write(mixed, TRUE)
    with open(mixed, "a", encoding="utf-8") as f:
        f.write(json.dumps({"arch": "sm_80", "kernels": [dataclasses.asdict(_geometries()[0])],
                            "measured_us": 5.0}) + "\n")
    with pytest.raises(ValueError, match="several arches"):
        calibrate(str(mixed))
