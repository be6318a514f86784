"""Build and pack the GPU check kit: everything a CUDA machine without a compiler needs.

`tvm-stitch gpu-kit --out DIR` writes into DIR:
- libs/: the suite built with TVM's default CUDA pipeline and with tvm-stitch
  (sm_90, kernels compiled to device code here by nvcc), each exported as a
  shared library; one small stitched CPU build for the dry run;
- site/tvm: the installed `tvm` package without its compiler library (TVM's
  runtime-only mode, `TVM_USE_RUNTIME_LIB=1`);
- wheels/: the `apache-tvm-ffi` wheel for CPython 3.12 (the GPU machine's Python);
- run_kit.py and torch_graphs.py (from tvm_stitch/gpu_runner), suite_data.py
  and manifest.json.
Inputs are not stored: the runner regenerates them (and numpy references)
from the seeds in the manifest, which keeps the pack small.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches, program_traffic
from tvm_stitch.tools.suite import SUITE, dims

LIMIT_BYTES = 60 << 20
_SKIP_IN_RUNTIME = ("libtvm_compiler.so", "3rdparty", "src", "include", "web", "__pycache__")
_KIT_FILES = ("run_kit.py", "torch_graphs.py")


def _export(mod, stitched: bool, path: str) -> dict:
    built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched)
    built.executable.export_library(path)
    modeled, ideal = program_traffic(built.lowered, {"kind": "cuda", "arch": "sm_90"})
    return {"launches": count_launches(built.lowered, built.executable), "modeled_bytes": modeled,
            "ideal_bytes": ideal}


def _copy_runtime(dest: str) -> None:
    import tvm

    src = os.path.dirname(tvm.__file__)
    shutil.copytree(src, os.path.join(dest, "tvm"), ignore=shutil.ignore_patterns(*_SKIP_IN_RUNTIME))


def _download_ffi_wheel(dest: str) -> str:
    """The apache-tvm-ffi wheel of the installed version, for CPython 3.12 on x86-64 Linux."""
    from importlib.metadata import version

    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", dest,
           f"apache-tvm-ffi=={version('apache-tvm-ffi')}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"download failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return ""


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def build_kit(out: str, size: str = "bench", graphs=None, dtypes=("float32", "float16"),
              wheel: bool = True, progress=None) -> dict:
    """Build, export and pack the kit into `out`; returns the manifest."""
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    import tvm.support.nvcc  # noqa: F401 - registers the CUDA compile callback (nvcc: fatbin here)

    if os.path.exists(out):
        shutil.rmtree(out)
    libs = os.path.join(out, "libs")
    os.makedirs(libs)
    names = graphs or list(SUITE)
    entries = []
    for i, name in enumerate(names):
        graph = SUITE[name]
        for dtype in dtypes:
            if dtype not in graph.dtypes:
                continue
            if progress:
                progress(f"[{i + 1}/{len(names)}] {name} {dtype}")
            mod = graph.build(dtype, dims(size))
            entry = {"graph": name, "dtype": dtype, "seed": 0}
            for key, stitched in (("default", False), ("stitched", True)):
                rel = os.path.join("libs", f"{name}_{dtype}_{key}.so")
                info = _export(mod, stitched, os.path.join(out, rel))
                entry[key] = rel
                entry[f"launches_{key}"] = info["launches"]
                entry[f"modeled_bytes_{key}"] = info["modeled_bytes"]
                entry["ideal_bytes"] = info["ideal_bytes"]
            entries.append(entry)
    dry_graph = "layernorm_softmax"
    dry_lib = os.path.join("libs", f"dryrun_{dry_graph}_cpu.so")
    cpu = build(SUITE[dry_graph].build("float32", dims("test")), {"kind": "llvm"}, stitched=True)
    cpu.executable.export_library(os.path.join(out, dry_lib))
    _copy_runtime(os.path.join(out, "site"))
    wheel_note = _download_ffi_wheel(os.path.join(out, "wheels")) if wheel else "skipped"
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _KIT_FILES:
        shutil.copy(os.path.join(here, "gpu_runner", name), os.path.join(out, name))
    for name in ("suite_data.py", "tolerance.py"):
        shutil.copy(os.path.join(here, name), os.path.join(out, name))
    manifest = {
        "size": size,
        "device": "CUDA sm_90",
        "entries": entries,
        "dry_run": {"graph": dry_graph, "dtype": "float32", "seed": 0, "size": "test", "library": dry_lib},
        "ffi_wheel": wheel_note or "ok",
    }
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    total = folder_bytes(out)
    manifest["bytes"] = total
    if total > LIMIT_BYTES:
        raise RuntimeError(f"the kit is {total / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB limit")
    return manifest
