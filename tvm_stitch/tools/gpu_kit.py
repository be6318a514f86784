"""Build and pack the GPU check kit: everything a CUDA machine without a compiler needs.

`tvm-stitch gpu-kit --out DIR` writes into DIR:
- libs/: every kit entry built with TVM's default CUDA pipeline and with
  tvm-stitch (planned for sm_90), its kernels compiled here to sm_90a cubins
  (nvcc to PTX, ptxas to the cubin; see device_code.py for why TVM needs a
  stand-in driver for that), each exported as a shared library; one small
  stitched CPU build for the dry run;
- site/tvm: the installed `tvm` package without its compiler library (TVM's
  runtime-only mode, `TVM_USE_RUNTIME_LIB=1`);
- wheels/: the `apache-tvm-ffi` wheel for CPython 3.12 (the GPU machine's Python);
- run_kit.py (from gpu_runner/), the workloads package (inputs, numpy
  references and PyTorch versions of the suite graphs; it imports no TVM),
  tolerance.py and manifest.json.
The entries: the suite at its bench size, (at that size) the HBM set,
shapes whose working set is several times the H200's 60 MB L2, and one
half-precision model step (MODEL_STEPS: the LLaMA block stack's forward in
float16, its weights compiled into the libraries, its inputs and PyTorch
float32 eager outputs stored under data/). Inputs are
not stored: the runner regenerates them (and numpy references) from the
seed and dims in the manifest, which keeps the pack small. The manifest
also records, per kernel, registers, static shared memory, stack and spills
from ptxas at build time.

The CUDA builds run in a child process (TVM's CUDA runtime, loaded there
through the stand-in driver, makes every CUDA build of its process call nvcc).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

from tvm_stitch.errors import UserInputError

LIMIT_BYTES = 40 << 20
ARCH = "sm_90a"
PLAN_TARGET = {"kind": "cuda", "arch": "sm_90"}
L2_BYTES = 60 << 20
STATIC_SHARED_BYTES = 48 << 10
# HBM set: graph -> (dims overriding the bench size, dtypes). Working sets: LayerNorm, RMSNorm and
# softmax 65536x1024 move 512 MiB in float32; cross-entropy 16384x8192 reads 512 MiB; Adam over
# 18 * 2360^2 = 100.3M parameters moves 2.8 GB (4 tensors read, 3 written).
HBM = {
    "layernorm": ({"rows": 65536, "cols": 1024}, ("float32", "float16")),
    "rmsnorm": ({"rows": 65536, "cols": 1024}, ("float32", "float16")),
    "softmax": ({"rows": 65536, "cols": 1024}, ("float32", "float16")),
    "cross_entropy": ({"rows": 16384, "vocab": 8192}, ("float32",)),
    "adam_update": ({"cols": 2360}, ("float32",)),
}
# Model steps: entry name -> (model, step, dtype); the model at MODEL_SIZE[the kit's size] (tools/models.py).
# Checked against PyTorch float32 eager by relative error (model_bench.relative_error) within MODEL_REL_ERROR.
MODEL_STEPS = {"llama_forward": ("llama", "forward", "float16")}
MODEL_SIZE = {"bench": "cpu", "test": "test"}
# Half-precision GEMMs (workloads/gemm.py): entry name -> (dims per kit size, dtypes). TVM's default build
# runs the float16 one on wmma, the bfloat16 one on the SIMT cores; the stitched build both on mma.sync.
GEMMS = {"gemm": ({"bench": {"rows": 4096, "cols": 4096, "depth": 4096},
                   "test": {"rows": 128, "cols": 96, "depth": 64}}, ("bfloat16", "float16"))}
MODEL_REL_ERROR = 3e-2
_SKIP_IN_RUNTIME = ("libtvm_compiler.so", "3rdparty", "src", "include", "web", "__pycache__")
_DRY_GRAPH = "layernorm_softmax"


def kit_work(size: str, graphs=None, dtypes=("float32", "float16"), hbm: bool = True) -> list:
    """The kit's entries: {name, graph, dtype, dims, seed}; the suite at `size`, then (when `hbm`)
    the HBM set, each named `<graph>_hbm`, then the GEMMs (GEMMS, in each of their dtypes: bfloat16
    whatever `dtypes` says), then the model steps (each {name, graph "model:<model>", model, step,
    dtype, model_size, rel_error}) whose dtype is among `dtypes`. `graphs`: suite graphs, GEMMs and
    model steps by name (default: all)."""
    from tvm_stitch.tools.workloads import SUITE, dims

    known = list(SUITE) + list(GEMMS) + list(MODEL_STEPS)
    names = graphs or known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserInputError(f"unknown suite graphs: {', '.join(unknown)} "
                             f"(known graphs, GEMMs and model steps: {', '.join(known)})")
    work = [{"name": n, "graph": n, "dtype": dt, "dims": dict(dims(size)), "seed": 0}
            for n in names if n in SUITE for dt in dtypes if dt in SUITE[n].dtypes]
    if hbm:
        for graph, (override, hbm_dtypes) in HBM.items():
            if graph in names:
                work += [{"name": f"{graph}_hbm", "graph": graph, "dtype": dt,
                          "dims": dict(dims(size), **override), "seed": 0}
                         for dt in hbm_dtypes if dt in dtypes]
    for name in (n for n in names if n in GEMMS):
        sizes, gemm_dtypes = GEMMS[name]
        work += [{"name": name, "graph": name, "dtype": dt, "dims": dict(sizes[size]), "seed": 0}
                 for dt in gemm_dtypes if dt in dtypes or dt == "bfloat16"]
    for name in (n for n in names if n in MODEL_STEPS):
        model, step, dtype = MODEL_STEPS[name]
        if dtype in dtypes:
            work.append({"name": name, "graph": f"model:{model}", "model": model, "step": step, "dtype": dtype,
                         "model_size": MODEL_SIZE[size], "dims": {}, "seed": 0, "rel_error": MODEL_REL_ERROR})
    return work


# The duration model (expected_seconds). Copy bandwidth: about 4.3 TB/s on an H200 (taken as 4.0);
# per launch a device-side gap, per VM call host work; the L2 flush writes 120 MB;
# numpy makes inputs and float64 references at 7-58 s per GB of work on this (shared) machine;
# torch.compile took 30 s for its first graph on the CPU here, later shapes are a guess.
_BANDWIDTH = 4.0e12
_LAUNCH_S, _HOST_CALL_S, _HOST_LAUNCH_S = 3e-6, 8e-6, 4e-6
_FLUSH_S = 2 * L2_BYTES / 3.0e12
_LOAD_S, _TRANSFER_BYTES_PER_S = 0.3, 10e9
_NUMPY_S_PER_BYTE = 30e-9
_STARTUP_S = 30.0
_COMPILE_FIRST_S, _COMPILE_NEXT_S = 30.0, 6.0


def _contender_seconds(ideal_bytes: int, launches: int, rounds: int) -> float:
    """One contender on one entry: load, correctness, the 3-call estimate, warm-up and `rounds`
    measurements of at least 20 ms of device time each, each call after an L2 flush."""
    device = ideal_bytes / _BANDWIDTH + _LAUNCH_S * launches
    per_call = max(device + _FLUSH_S, _HOST_CALL_S + _HOST_LAUNCH_S * launches)
    calls = math.ceil(0.020 / device)
    return _LOAD_S + 3 * ideal_bytes / _TRANSFER_BYTES_PER_S + (rounds + 1) * calls * per_call + 3 * per_call


def expected_seconds(entries: list, workers: int = 8, rounds: int = 4) -> dict:
    """Expected wall time of the runner's quick and full modes on the H200 machine, from the work.

    Quick: startup, plus the larger of the device work and the numpy work spread over `workers`
    processes (it overlaps the device work), never less than the largest single entry's numpy.
    Full adds the PyTorch pass (its data is kept from the first): eager and compiled timed like a
    TVM contender (the default build's launch count stands in for theirs), plus compile time."""
    tvm = sum(_contender_seconds(e["ideal_bytes"], e[f"launches_{b}"], rounds)
              for e in entries for b in ("default", "stitched"))
    numpy = [_NUMPY_S_PER_BYTE * e["ideal_bytes"] for e in entries]
    quick = _STARTUP_S + max(tvm, sum(numpy) / workers, max(numpy, default=0.0))
    torch = sum(2 * _contender_seconds(e["ideal_bytes"], e["launches_default"], rounds) for e in entries)
    torch += _COMPILE_FIRST_S + _COMPILE_NEXT_S * (len(entries) - 1) if entries else 0.0
    return {"quick": round(quick), "full": round(quick + torch), "device_work_quick": round(tvm),
            "numpy_work": round(sum(numpy))}


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def build_kit(out: str, size: str = "bench", graphs=None, dtypes=("float32", "float16"), wheel: bool = True,
              hbm: bool | None = None, progress=None) -> dict:
    """Build, export and pack the kit into `out`; returns the manifest. `hbm` (default: at the bench
    size only) adds the HBM set. Raises RuntimeError when a step fails or the pack is too large."""
    from tvm_stitch.tools import device_code

    work = kit_work(size, graphs, dtypes, size == "bench" if hbm is None else hbm)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "libs"))
    with tempfile.TemporaryDirectory(prefix="tvm-stitch-driver-") as driver:
        device_code.write_standin_driver(driver)
        _build_in_child(out, work, driver, progress)
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    dry = {"graph": _DRY_GRAPH, "dtype": "float32", "seed": 0, "dims": _dims("test"),
           "library": os.path.join("libs", f"dryrun_{_DRY_GRAPH}_cpu.so")}
    _export_dry_run(os.path.join(out, dry["library"]))
    _copy_runtime(os.path.join(out, "site"))
    wheel_note = _download_ffi_wheel(os.path.join(out, "wheels")) if wheel else "skipped"
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "gpu_runner", "run_kit.py"), os.path.join(out, "run_kit.py"))
    shutil.copy(os.path.join(here, "tolerance.py"), os.path.join(out, "tolerance.py"))
    shutil.copytree(os.path.join(here, "workloads"), os.path.join(out, "workloads"),
                    ignore=shutil.ignore_patterns("__pycache__", "relax_blocks.py"))
    manifest.update(size=size, dry_run=dry, ffi_wheel=wheel_note or "ok",
                    expected_seconds=expected_seconds(manifest["entries"]))
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    manifest["bytes"] = folder_bytes(out)
    if manifest["bytes"] > LIMIT_BYTES:
        raise RuntimeError(f"the kit is {manifest['bytes'] / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB limit")
    return manifest


def _dims(size: str) -> dict:
    from tvm_stitch.tools.workloads import dims

    return dict(dims(size))


def _build_in_child(out: str, work: list, driver: str, progress) -> None:
    """Run `_build_cuda` in a fresh process whose `import tvm` finds the stand-in driver."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (driver, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    work_file = os.path.join(out, "work.json")
    with open(work_file, "w", encoding="utf-8") as f:
        json.dump(work, f)
    child = subprocess.Popen([sys.executable, "-m", "tvm_stitch.tools.gpu_kit", out, work_file], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail = []
    for line in child.stderr:
        tail = (tail + [line.rstrip()])[-40:]
        if progress and line.startswith("["):
            progress(line.rstrip())
    child.wait()
    os.remove(work_file)
    if child.returncode != 0:
        raise RuntimeError("building the kit's CUDA libraries failed:\n" + "\n".join(tail))


def _build_cuda(out: str, work: list) -> None:
    """(In the child) build, compile and export every entry; write manifest.json."""
    from tvm_stitch.tools import device_code

    if not device_code.cuda_runtime_loaded():
        raise RuntimeError("TVM's CUDA runtime did not load (is the stand-in libcuda.so.1 on LD_LIBRARY_PATH?)")
    resources: dict = {}
    device_code.register_compiler(ARCH, resources)
    entries = []
    for i, item in enumerate(work):
        print(f"[{i + 1}/{len(work)}] {item['name']} {item['dtype']}", file=sys.stderr, flush=True)
        entry = dict(item)
        mod = _entry_module(out, entry)
        for key, stitched in (("default", False), ("stitched", True)):
            rel = os.path.join("libs", f"{item['name']}_{item['dtype']}_{key}.so")
            resources.clear()
            info = _export_cuda(mod, stitched, os.path.join(out, rel), resources)
            entry["ideal_bytes"] = info.pop("ideal_bytes")
            entry.update({f"{k}_{key}": v for k, v in info.items()})
            entry[key] = rel
        entries.append(entry)
    manifest = {"device": f"CUDA, planned for {PLAN_TARGET['arch']}, device code {ARCH} cubins",
                "arch": ARCH, "plan_arch": PLAN_TARGET["arch"], "entries": entries,
                "warnings": resource_warnings(entries)}
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def resource_warnings(entries: list) -> list:
    """Kernels whose ptxas figures predict trouble at launch: static shared memory over the 48 KiB
    that CUDA guarantees a block without opting in, or register spills."""
    warnings = []
    for entry in entries:
        for build in ("default", "stitched"):
            for kernel, res in entry.get(f"kernels_{build}", {}).items():
                where = f"{entry['name']} {entry['dtype']} {build} {kernel}"
                if res.get("shared_bytes", 0) > STATIC_SHARED_BYTES:
                    warnings.append(f"{where}: {res['shared_bytes']} B static shared memory (> 48 KiB)")
                if res.get("spill_store_bytes", 0):
                    warnings.append(f"{where}: {res['spill_store_bytes']} B register spill stores")
    return warnings


def _entry_module(out: str, entry: dict):
    """The Relax module of a kit entry. A model step is imported from PyTorch, its inputs and float32
    eager outputs written to data/<name>_<dtype>.npz (recorded in `entry["data"]`)."""
    from tvm_stitch.tools.workloads import graph

    if "model" not in entry:
        return graph(entry["graph"]).build(entry["dtype"], entry["dims"])
    import numpy as np

    from tvm_stitch.tools.model_bench import import_step

    mod, inputs, expected = import_step(entry["model"], entry["step"], entry["model_size"], entry["dtype"])
    entry["data"] = os.path.join("data", f"{entry['name']}_{entry['dtype']}.npz")
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    np.savez(os.path.join(out, entry["data"]), **{f"input_{i}": a for i, a in enumerate(inputs)},
             **{f"expected_{i}": e for i, e in enumerate(expected)})
    return mod


def _export_cuda(mod, stitched: bool, path: str, resources: dict) -> dict:
    from tvm_stitch.tools import device_code
    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.launches import count_launches, cuda_source, program_traffic

    built = build(mod, PLAN_TARGET, stitched)
    built.executable.export_library(path)
    modeled, ideal = program_traffic(built.lowered, PLAN_TARGET)
    source = cuda_source(built.executable)
    info = {"launches": count_launches(built.lowered, built.executable), "modeled_bytes": modeled,
            "ideal_bytes": ideal, "kernels": {k: v for k, v in sorted(resources.items()) if f" {k}(" in source},
            "device_code": device_code.device_code_kinds(path), **modeled_times(built.lowered)}
    if built.report is not None:
        packed = ["independent"] if built.report.packs else []
        info["schemes"] = sorted({plan.scheme for plan in built.report.plans}) + packed
    return info


def modeled_times(lowered) -> dict:
    """{"modeled_us": the module's modeled time, "modeled": per PrimFunc its calls, its modeled
    microseconds per call and its kernels' geometry}, for the runner to record beside the measured times."""
    import dataclasses

    from tvm_stitch.planning.spec import TargetSpec
    from tvm_stitch.target import as_target
    from tvm_stitch.tools.module_time import module_time

    priced = module_time(lowered, TargetSpec.from_target(as_target(PLAN_TARGET)))
    return {"modeled_us": priced.us, "modeled": {
        name: {"calls": calls, "modeled_us": sum(t.us for t in times),
               "kernels": [dataclasses.asdict(t.geometry) for t in times]}
        for name, calls, times in priced.kernels}}


def _export_dry_run(path: str) -> None:
    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.workloads import SUITE

    cpu = build(SUITE[_DRY_GRAPH].build("float32", _dims("test")), {"kind": "llvm"}, stitched=True)
    cpu.executable.export_library(path)


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


if __name__ == "__main__":
    with open(sys.argv[2], encoding="utf-8") as work_json:
        _build_cuda(sys.argv[1], json.load(work_json))
