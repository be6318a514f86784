"""Run the GPU check kit: correctness and timings of TVM-default vs tvm-stitch kernels.

Runs from inside a pack made by `tvm-stitch gpu-kit` (the pack holds this
file, the exported libraries, a runtime-only `tvm`, the `apache-tvm-ffi`
wheel for CPython 3.12, suite_data.py and torch_graphs.py). Needs numpy;
PyTorch for the eager / torch.compile baselines and the copy bandwidth.

    python3 run_kit.py --out results/           # on a CUDA machine
    python3 run_kit.py --dry-run --out /tmp/r   # anywhere: the pack loads and the CPU build runs

Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SANITIZE = {"row-resident": "layernorm_softmax", "column": "layernorm_backward", "independent": "adam_update"}


def _import_runtime():
    """Import the pack's runtime-only tvm (and tvm_ffi from its wheel when missing)."""
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        wheels = glob.glob(os.path.join(HERE, "wheels", "*.whl"))
        target = "/tmp/tvm-stitch-kit-site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", target, *wheels], check=True)
        sys.path.insert(0, target)
    sys.path.insert(0, os.path.join(HERE, "site"))
    sys.path.insert(0, HERE)
    import tvm

    return tvm


def _load_cuda_runtime(tvm) -> None:
    """Register TVM's CUDA module loader: libcudart first, then libtvm_runtime_cuda."""
    candidates = ["libcudart.so.13"]
    for pattern in ("/usr/local/cuda*/lib64/libcudart.so.13*", "/usr/local/cuda*/targets/*/lib/libcudart.so.13*"):
        candidates += sorted(glob.glob(pattern))
    try:
        import torch

        candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**",
                                                    "libcudart.so.13*"), recursive=True))
    except ImportError:
        pass
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    ctypes.CDLL(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)


def _vm(tvm, path: str, device_type: int):
    lib = tvm.runtime.load_module(path)
    vm = lib["vm_load_executable"]()
    if device_type == 1:
        vm["vm_initialization"](1, 0, 2)
    else:
        vm["vm_initialization"](device_type, 0, 2, 1, 0, 2)
    return lib, vm


def _flatten(result) -> list:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [a for r in result for a in _flatten(r)]


def _agree(outs, refs, dtype) -> tuple:
    import numpy as np

    from tolerance import tolerance

    rtol, atol = tolerance(dtype)
    err = max(float(np.max(np.abs(o.astype(np.float64) - r))) if np.size(r) else 0.0 for o, r in zip(outs, refs))
    ok = len(outs) == len(refs) and all(np.allclose(o.astype(np.float64), r, rtol=rtol, atol=atol)
                                        for o, r in zip(outs, refs))
    return ok, err


def _inputs(entry: dict, size: str):
    import numpy as np
    import suite_data

    data = suite_data.DATA[entry["graph"]]
    inputs = data.inputs(np.random.default_rng(entry["seed"]), entry["dtype"], suite_data.dims(size))
    return inputs, suite_data.reference_of(data.reference, inputs)


def _time_vm(tvm, vm, dev, args, repeat: int) -> float:
    timer = vm.time_evaluator("main", dev, number=10, repeat=repeat)
    return float(statistics.median(timer(*args).results) * 1e3)


def _time_torch(fn, args, repeat: int) -> float:
    import torch

    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return float(statistics.median(times))


def _copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_torch(lambda: dst.copy_(src), (), 5)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _torch_baselines(entry: dict, inputs: list, repeat: int) -> dict:
    try:
        import torch
        import torch_graphs
    except ImportError as err:
        return {"torch_error": str(err)}
    args = [torch.from_numpy(a).cuda() for a in inputs]
    fn = torch_graphs.GRAPHS[entry["graph"]]
    out = {"torch_eager_ms": _time_torch(fn, args, repeat)}
    try:
        out["torch_compile_ms"] = _time_torch(torch.compile(fn), args, repeat)
    except Exception as err:  # noqa: BLE001 - a compile failure is a result, not a crash
        out["torch_compile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


def _sanitize(manifest: dict, args) -> list:
    results = []
    for scheme, graph in SANITIZE.items():
        entry = next((e for e in manifest["entries"] if e["graph"] == graph and e["dtype"] == "float32"), None)
        if entry is None:
            continue
        for tool in ("memcheck", "racecheck"):
            cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", sys.executable, __file__,
                   "--only", graph, "--once", "--out", "/tmp/tvm-stitch-sanitize"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.sanitize_timeout)
                summary = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR SUMMARY" in line]
                results.append({"scheme": scheme, "graph": graph, "tool": tool, "exit": done.returncode,
                                "summary": summary[-1] if summary else ""})
            except (OSError, subprocess.TimeoutExpired) as err:
                results.append({"scheme": scheme, "graph": graph, "tool": tool, "error": type(err).__name__})
    return results


def _dry_run(tvm, manifest: dict) -> dict:
    """On any machine: every library is in the pack, inputs and references regenerate, the CPU build runs."""
    missing = [e[k] for e in manifest["entries"] for k in ("default", "stitched")
               if not os.path.exists(os.path.join(HERE, e[k]))]
    dry = manifest["dry_run"]
    inputs, refs = _inputs(dry, dry["size"])
    _lib, vm = _vm(tvm, os.path.join(HERE, dry["library"]), 1)
    outs = _flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))
    ok, err = _agree(outs, refs, dry["dtype"])
    for entry in manifest["entries"]:
        _inputs(entry, "test")
    return {"dry_run": True, "missing_libraries": missing, "cpu_build_correct": ok, "cpu_build_max_error": err,
            "entries": len(manifest["entries"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: check that the pack loads and the CPU build runs")
    parser.add_argument("--only", default="", help="comma-separated graphs")
    parser.add_argument("--once", action="store_true", help="run each build once, no timing (for compute-sanitizer)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--sanitize", action="store_true", help="also run compute-sanitizer memcheck and racecheck")
    parser.add_argument("--sanitize-timeout", type=int, default=120)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(HERE, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    tvm = _import_runtime()
    if args.dry_run:
        result = _dry_run(tvm, manifest)
        _write(args.out, result, [])
        print(json.dumps(result))
        return 0 if result["cpu_build_correct"] and not result["missing_libraries"] else 1

    _load_cuda_runtime(tvm)
    dev = tvm.cuda(0)
    started = time.time()
    header = {"device": manifest.get("device", ""), "size": manifest["size"], "date": time.strftime("%Y-%m-%d")}
    try:
        import torch

        header["gpu"] = torch.cuda.get_device_name(0)
        if not args.once:
            header["copy_bandwidth_gbs"] = _copy_bandwidth()
    except ImportError:
        header["gpu"] = "unknown (no torch)"
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for entry in manifest["entries"]:
        if only and entry["graph"] not in only:
            continue
        inputs, refs = _inputs(entry, manifest["size"])
        row = dict(entry)
        for build in ("default", "stitched"):
            _lib, vm = _vm(tvm, os.path.join(HERE, entry[build]), 2)
            tensors = [tvm.runtime.tensor(a, dev) for a in inputs]
            ok, err = _agree(_flatten(vm["main"](*tensors)), refs, entry["dtype"])
            row[f"{build}_correct"], row[f"{build}_max_error"] = ok, err
            if not args.once:
                row[f"{build}_ms"] = _time_vm(tvm, vm, dev, tensors, args.repeat)
        if not args.once:
            row["speedup"] = row["default_ms"] / row["stitched_ms"]
            bandwidth = header.get("copy_bandwidth_gbs")
            if bandwidth:
                row["stitched_gbs"] = entry["ideal_bytes"] / (row["stitched_ms"] * 1e-3) / 1e9
                row["stitched_fraction_of_copy"] = row["stitched_gbs"] / bandwidth
            if not args.no_torch:
                row.update(_torch_baselines(entry, inputs, args.repeat))
        rows.append(row)
        print(f"{entry['graph']} {entry['dtype']}: stitched {'ok' if row['stitched_correct'] else 'WRONG'}"
              + (f", {row['speedup']:.2f}x" if "speedup" in row else ""), flush=True)
    header["sanitizer"] = _sanitize(manifest, args) if args.sanitize else []
    header["seconds"] = time.time() - started
    _write(args.out, header, rows)
    return 0 if all(r["stitched_correct"] for r in rows) else 1


def _write(out: str, header: dict, rows: list) -> None:
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"header": header, "rows": rows}, f, indent=2)
    lines = [f"# tvm-stitch GPU kit results ({header.get('gpu', header.get('dry_run', ''))}, {header.get('date', '')})",
             "", "```", json.dumps(header, indent=1), "```", ""]
    if rows:
        cols = ["graph", "dtype", "launches_default", "launches_stitched", "default_correct", "stitched_correct",
                "default_ms", "stitched_ms", "speedup", "stitched_fraction_of_copy", "torch_eager_ms",
                "torch_compile_ms"]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
