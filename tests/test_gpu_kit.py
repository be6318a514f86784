"""The GPU check kit builds, packs under its size limit, and its runner's dry run passes on the CPU."""

import json
import os
import subprocess
import sys

from tvm_stitch.tools.gpu_kit import LIMIT_BYTES, build_kit, folder_bytes


def test_kit_builds_packs_and_dry_runs(tmp_path):
    out = str(tmp_path / "kit")
    # The ffi wheel download needs the package index; the pack is checked without it here.
    manifest = build_kit(out, size="test", graphs=["layernorm_softmax", "adam_update"], wheel=False)
    assert [(e["graph"], e["dtype"]) for e in manifest["entries"]] == [
        ("layernorm_softmax", "float32"), ("layernorm_softmax", "float16"), ("adam_update", "float32")]
    for entry in manifest["entries"]:
        assert entry["launches_stitched"] < entry["launches_default"]
        assert os.path.getsize(os.path.join(out, entry["stitched"])) > 0
    assert not os.path.exists(os.path.join(out, "site", "tvm", "lib", "libtvm_compiler.so"))
    assert folder_bytes(out) < LIMIT_BYTES - (8 << 20)  # room for the ~3 MB ffi wheel
    results = str(tmp_path / "results")
    done = subprocess.run([sys.executable, os.path.join(out, "run_kit.py"), "--dry-run", "--out", results],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(results, "results.json"), encoding="utf-8") as f:
        header = json.load(f)["header"]
    assert header["cpu_build_correct"] and not header["missing_libraries"]
