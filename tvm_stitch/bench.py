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


def run_bench(graphs: list, dtype: str = "float32", size: str = "bench", target: str = "llvm",
              progress=sys.stderr, seed: int = 0) -> list:
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
        rows.append(row)
    return rows


def format_table(rows: list) -> str:
    header = ("graph", "dtype", "shape", "CUDA launches (default -> stitched)",
              "CUDA modeled MB (default -> stitched / ideal)",
              "CPU ms default", "CPU ms stitched", "speedup", "max abs err default", "max abs err stitched",
              "stitched correct")
    has_gpu = any(not math.isnan(r.gpu_ms_default) for r in rows)
    if has_gpu:
        header += ("GPU ms default", "GPU ms stitched")
    lines = [header]
    for r in rows:
        line = (r.graph, r.dtype, r.shape, f"{r.launches_default} -> {r.launches_stitched}",
                f"{r.mb_default:.1f} -> {r.mb_stitched:.1f} / {r.mb_ideal:.1f}",
                f"{r.cpu_ms_default:.3f}", f"{r.cpu_ms_stitched:.3f}", f"{r.speedup:.2f}x",
                f"{r.default_error:.1e}", f"{r.max_error:.1e}", "yes" if r.agree else "NO")
        if has_gpu:
            line += (f"{r.gpu_ms_default:.4f}", f"{r.gpu_ms_stitched:.4f}")
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
