"""`tvm-stitch bench`: the suite built with TVM's default pipeline and with tvm-stitch.

Per graph: both builds run on the CPU (llvm) on the same random inputs and
are checked against numpy and each other; CUDA kernel launches per forward
come from the CUDA builds (no GPU needed); CPU times of both builds are
measured in the same run and reported with their ratio. With a GPU present
and `--target cuda`, the CUDA builds are timed too.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from .build import build, run_cpu, time_cpu
from .kernels import count_launches
from .traffic import program_traffic
from .suite import SUITE, dims, reference

TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2)}


@dataclass
class BenchRow:
    graph: str
    dtype: str
    shape: str
    launches_default: int
    launches_stitched: int
    mb_default: float  # modeled global-memory traffic of the CUDA build, MB per forward
    mb_stitched: float
    mb_ideal: float  # graph inputs read once + outputs written once
    cpu_ms_default: float
    cpu_ms_stitched: float
    max_error: float  # stitched vs numpy (float64), max abs over outputs
    default_error: float  # TVM's default build vs numpy, the same way
    agree: bool  # the stitched build is within the dtype's tolerance of numpy
    gpu_ms_default: float = float("nan")
    gpu_ms_stitched: float = float("nan")
    torch_eager_ms: float = float("nan")  # PyTorch eager on the CPU, same inputs
    torch_compile_ms: float = float("nan")  # torch.compile (Inductor) on the CPU

    @property
    def speedup(self) -> float:
        return self.cpu_ms_default / self.cpu_ms_stitched


def machine_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _max_error(outs: list, refs: list) -> float:
    return max(float(np.max(np.abs(o.astype(np.float64) - r))) if np.size(r) else 0.0
               for o, r in zip(outs, refs))


def _agree(outs: list, refs: list, dtype: str) -> bool:
    rtol, atol = TOLERANCE[dtype]
    return len(outs) == len(refs) and all(
        np.allclose(o.astype(np.float64), r, rtol=rtol, atol=atol) for o, r in zip(outs, refs)
    )


def _gpu_times(mod, inputs):
    """(default ms, stitched ms) on a CUDA device, or NaNs without one."""
    import tvm
    from tvm import relax

    dev = tvm.cuda()
    if not dev.exist:
        return float("nan"), float("nan")
    times = []
    for stitched in (False, True):
        built = build(mod, {"kind": "cuda", "arch": "sm_" + dev.compute_version.replace(".", "")}, stitched)
        vm = relax.VirtualMachine(built.executable, dev)
        args = [tvm.runtime.tensor(a, dev) for a in inputs]
        timer = vm.time_evaluator("main", dev, number=10, repeat=5)
        times.append(float(np.median(timer(*args).results) * 1e3))
    return times[0], times[1]


def _time_call(fn, min_ms: float = 200.0) -> float:
    """Median milliseconds per call over 5 repeats of at least `min_ms` each."""
    for _ in range(3):
        fn()
    results = []
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = (time.perf_counter() - start) * 1e3
            if elapsed >= min_ms:
                break
        results.append(elapsed / calls)
    return float(np.median(results))


def _torch_times(name: str, inputs: list) -> tuple:
    """(eager ms, torch.compile ms) of the graph in PyTorch on the CPU, NaNs without torch."""
    try:
        import torch
    except ImportError:
        return float("nan"), float("nan")
    from .gpu_runner.torch_graphs import GRAPHS

    torch.set_num_threads(int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1)))
    args = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]
    fn = GRAPHS[name]
    compiled = torch.compile(fn)
    with torch.no_grad():
        eager = _time_call(lambda: fn(*args))
        try:
            inductor = _time_call(lambda: compiled(*args))
        except Exception:  # noqa: BLE001 - Inductor failing on a graph is a result, shown as NaN
            inductor = float("nan")
    return eager, inductor


def run_bench(graphs: list, dtype: str = "float32", size: str = "bench", target: str = "llvm",
              progress=sys.stderr, seed: int = 0, with_torch: bool = False) -> list:
    rows = []
    d = dims(size)
    for i, name in enumerate(graphs, 1):
        graph = SUITE[name]
        if dtype not in graph.dtypes:
            continue
        print(f"[{i}/{len(graphs)}] {name} ({dtype})", file=progress, flush=True)
        mod = graph.build(dtype, d)
        cuda = {}
        for key in (False, True):
            built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=key)
            cuda[key] = (count_launches(built.lowered, built.executable), program_traffic(built.lowered))
        inputs = graph.inputs(np.random.default_rng(seed), dtype, d)
        refs = reference(graph, inputs)
        default = build(mod, {"kind": "llvm"}, stitched=False)
        stitched = build(mod, {"kind": "llvm"}, stitched=True)
        outs = run_cpu(stitched.executable, inputs)
        default_outs = run_cpu(default.executable, inputs)
        row = BenchRow(
            graph=name,
            dtype=dtype,
            shape="x".join(str(s) for s in inputs[0].shape),
            launches_default=cuda[False][0],
            launches_stitched=cuda[True][0],
            mb_default=cuda[False][1][0] / 1e6,
            mb_stitched=cuda[True][1][0] / 1e6,
            mb_ideal=cuda[True][1][1] / 1e6,
            cpu_ms_default=time_cpu(default.executable, inputs),
            cpu_ms_stitched=time_cpu(stitched.executable, inputs),
            max_error=_max_error(outs, refs),
            default_error=_max_error(default_outs, refs),
            agree=_agree(outs, refs, dtype),
        )
        if target == "cuda":
            row.gpu_ms_default, row.gpu_ms_stitched = _gpu_times(mod, inputs)
        if with_torch:
            row.torch_eager_ms, row.torch_compile_ms = _torch_times(name, inputs)
        rows.append(row)
    return rows


def format_table(rows: list) -> str:
    header = ("graph", "dtype", "shape", "CUDA launches (default -> stitched)",
              "CUDA modeled MB (default -> stitched / ideal)",
              "CPU ms default", "CPU ms stitched", "speedup", "max abs err default", "max abs err stitched",
              "stitched correct")
    has_gpu = any(not math.isnan(r.gpu_ms_default) for r in rows)
    has_torch = any(not math.isnan(r.torch_eager_ms) for r in rows)
    if has_gpu:
        header += ("GPU ms default", "GPU ms stitched")
    if has_torch:
        header += ("torch eager ms", "torch.compile ms", "stitched vs torch.compile")
    lines = [header]
    for r in rows:
        line = (r.graph, r.dtype, r.shape, f"{r.launches_default} -> {r.launches_stitched}",
                f"{r.mb_default:.1f} -> {r.mb_stitched:.1f} / {r.mb_ideal:.1f}",
                f"{r.cpu_ms_default:.3f}", f"{r.cpu_ms_stitched:.3f}", f"{r.speedup:.2f}x",
                f"{r.default_error:.1e}", f"{r.max_error:.1e}", "yes" if r.agree else "NO")
        if has_gpu:
            line += (f"{r.gpu_ms_default:.4f}", f"{r.gpu_ms_stitched:.4f}")
        if has_torch:
            line += (f"{r.torch_eager_ms:.3f}", f"{r.torch_compile_ms:.3f}",
                     f"{r.torch_compile_ms / r.cpu_ms_stitched:.2f}x")
        lines.append(line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if rows:
        geo = math.exp(sum(math.log(r.speedup) for r in rows) / len(rows))
        ld = sum(r.launches_default for r in rows)
        ls = sum(r.launches_stitched for r in rows)
        md = sum(r.mb_default for r in rows)
        ms = sum(r.mb_stitched for r in rows)
        out.append("")
        if has_torch:
            valid = [r for r in rows if not math.isnan(r.torch_compile_ms)]
            vs = math.exp(sum(math.log(r.torch_compile_ms / r.cpu_ms_stitched) for r in valid) / max(1, len(valid)))
            out.append(f"CPU geomean of torch.compile time / tvm-stitch time: {vs:.2f}x over {len(valid)} graphs")
        out.append(f"CPU geomean speedup {geo:.2f}x over TVM's default pipeline (llvm); "
                   f"CUDA launches {ld} -> {ls} ({100.0 * (ld - ls) / ld:.0f}% fewer); "
                   f"modeled CUDA traffic {md:.0f} -> {ms:.0f} MB ({100.0 * (md - ms) / md:.0f}% less)")
    return "\n".join(out)


def write_json(rows: list, path: str, extra: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = dict(extra)
    data["rows"] = [dict(asdict(r), speedup=r.speedup) for r in rows]
    with open(path, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=2, default=str)


def bench_metadata(size: str, dtype: str) -> dict:
    import tvm

    return {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%d"),
        "tvm": tvm.__version__,
        "size": size,
        "dtype": dtype,
        "threads": os.environ.get("TVM_NUM_THREADS", str(os.cpu_count())),
    }
