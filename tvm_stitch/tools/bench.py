"""`tvm-stitch bench`: the suite built with TVM's default pipeline and with tvm-stitch.

Per graph: both builds run on the CPU (llvm for this machine's CPU model)
on the same random inputs and are checked against numpy; CUDA kernel
launches per forward come from the CUDA builds (no GPU needed); CPU times
of both builds, of numpy and (optionally) of PyTorch eager and
torch.compile are measured in the same run and reported as ratios, with the
stitched build's effective bandwidth (inputs read once, outputs written
once) as a fraction of this machine's copy bandwidth, measured in the same
run too. With a GPU present and `--target cuda`, the CUDA builds are timed.
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

from tvm_stitch.tools.build import alternating_times, build, python_round, run_cpu, vm_round
from tvm_stitch.tools.launches import count_launches, program_traffic
from tvm_stitch.tools.workloads import SUITE, dims, reference
from tvm_stitch.target import host_target
from tvm_stitch.threads import cpu_threads
from tvm_stitch.tools.tolerance import tolerance



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
    agree: bool  # within the dtype's tolerance of numpy, or (float32 sums too long for it) closer than TVM's default
    gpu_ms_default: float = float("nan")
    gpu_ms_stitched: float = float("nan")
    torch_eager_ms: float = float("nan")  # PyTorch eager on the CPU, same inputs
    torch_compile_ms: float = float("nan")  # torch.compile (Inductor) on the CPU
    numpy_ms: float = float("nan")  # the numpy reference, in the inputs' dtype
    io_bytes: int = 0  # inputs read once + outputs written once
    copy_gbps: float = float("nan")  # this machine's copy bandwidth, measured in the same run

    @property
    def speedup(self) -> float:
        return self.cpu_ms_default / self.cpu_ms_stitched

    @property
    def vs_torch_compile(self) -> float:
        """torch.compile time / tvm-stitch time (above 1: tvm-stitch faster)."""
        return self.torch_compile_ms / self.cpu_ms_stitched

    @property
    def gbps_stitched(self) -> float:
        """Effective bandwidth of the stitched build: inputs read once + outputs written once."""
        return self.io_bytes / self.cpu_ms_stitched / 1e6

    @property
    def copy_fraction(self) -> float:
        return self.gbps_stitched / self.copy_gbps


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
    rtol, atol = tolerance(dtype)
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


def copy_bandwidth(target=None, elements: int = 1 << 26) -> float:
    """GB/s of a parallel, vectorised float32 copy of `elements` (256 MB) built with TVM:
    bytes read + bytes written per second, the STREAM convention."""
    import tvm
    from tvm import s_tir, te

    target = target or host_target()
    src = te.placeholder((elements,), "float32", name="src")
    dst = te.compute((elements,), lambda i: src[i], name="dst")
    sch = s_tir.Schedule(te.create_prim_func([src, dst]))
    (loop,) = sch.get_loops(sch.get_sblock("dst"))
    outer, inner = sch.split(loop, [None, 64])
    sch.parallel(outer)
    sch.vectorize(inner)
    lib = tvm.compile(sch.mod, target=target).jit()
    dev = tvm.cpu()
    a = tvm.runtime.tensor(np.ones(elements, "float32"), dev)
    b = tvm.runtime.tensor(np.zeros(elements, "float32"), dev)
    timer = lib.time_evaluator("main", dev, number=1, repeat=5, min_repeat_ms=200)
    seconds = float(np.median(timer(a, b).results))
    return 2 * 4 * elements / seconds / 1e9


def _torch_rounds(name: str, inputs: list) -> dict:
    """Round functions of PyTorch eager and torch.compile (Inductor) on the graph, on the CPU;
    none without torch."""
    try:
        import torch
    except ImportError:
        return {}
    torch.set_num_threads(cpu_threads())
    args = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]
    fn, compiled = SUITE[name].torch, torch.compile(SUITE[name].torch)

    def call(f):
        def run():
            with torch.no_grad():
                return f(*args)
        return python_round(run)

    return {"torch_eager": call(fn), "torch_compile": call(compiled)}


def run_bench(graphs: list, dtype: str = "float32", size: str = "bench", target: str = "llvm",
              progress=None, seed: int = 0, with_torch: bool = False, copy_gbps: float | None = None) -> list:
    """One BenchRow per graph of `graphs` that has `dtype`; a progress line per graph on `progress`
    (default: the current sys.stderr)."""
    progress = progress or sys.stderr
    rows = []
    d = dims(size)
    cpu = host_target()
    copy_gbps = copy_bandwidth(cpu) if copy_gbps is None else copy_gbps
    for i, name in enumerate(graphs, 1):
        graph = SUITE[name]
        if dtype not in graph.dtypes:
            continue
        print(f"[{i}/{len(graphs)}] {name} ({dtype})", file=progress, flush=True)
        mod = graph.build(dtype, d)
        cuda = {}
        gpu = {"kind": "cuda", "arch": "sm_90"}
        for key in (False, True):
            built = build(mod, gpu, stitched=key)
            cuda[key] = (count_launches(built.lowered, built.executable), program_traffic(built.lowered, gpu))
        inputs = graph.inputs(np.random.default_rng(seed), dtype, d)
        refs = reference(graph, inputs)
        default = build(mod, cpu, stitched=False)
        stitched = build(mod, cpu, stitched=True)
        outs = run_cpu(stitched.executable, inputs)
        default_outs = run_cpu(default.executable, inputs)
        contenders = {"default": vm_round(default.executable, inputs),
                      "stitched": vm_round(stitched.executable, inputs),
                      "numpy": python_round(lambda: graph.reference(*inputs))}
        if with_torch:
            contenders.update(_torch_rounds(name, inputs))
        ms = alternating_times(contenders)
        row = BenchRow(
            graph=name,
            dtype=dtype,
            shape="x".join(str(s) for s in inputs[0].shape),
            launches_default=cuda[False][0],
            launches_stitched=cuda[True][0],
            mb_default=cuda[False][1][0] / 1e6,
            mb_stitched=cuda[True][1][0] / 1e6,
            mb_ideal=cuda[True][1][1] / 1e6,
            cpu_ms_default=ms["default"],
            cpu_ms_stitched=ms["stitched"],
            max_error=_max_error(outs, refs),
            default_error=_max_error(default_outs, refs),
            agree=_agree(outs, refs, dtype) or _max_error(outs, refs) <= _max_error(default_outs, refs),
            numpy_ms=ms["numpy"],
            io_bytes=sum(a.nbytes for a in inputs) + sum(o.nbytes for o in outs),
            copy_gbps=copy_gbps,
            torch_eager_ms=ms.get("torch_eager", float("nan")),
            torch_compile_ms=ms.get("torch_compile", float("nan")),
        )
        if target == "cuda":
            row.gpu_ms_default, row.gpu_ms_stitched = _gpu_times(mod, inputs)
        print(f"    default {row.cpu_ms_default:.3f} ms, stitched {row.cpu_ms_stitched:.3f} ms "
              f"({row.speedup:.2f}x), {row.gbps_stitched:.1f} GB/s = {100 * row.copy_fraction:.0f}% of copy"
              + (f", torch.compile {row.torch_compile_ms:.3f} ms" if with_torch else "")
              + ("" if row.agree else ", WRONG RESULT"), file=progress, flush=True)
        rows.append(row)
    return rows


def geomean(values: list) -> float:
    """The geometric mean of `values`, NaNs (contenders that failed) left out; NaN if none is left."""
    values = [v for v in values if not math.isnan(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def format_table(rows: list) -> str:
    header = ("graph", "dtype", "shape", "CUDA launches (default -> stitched)",
              "CUDA modeled MB (default -> stitched / ideal)",
              "CPU ms default", "CPU ms stitched", "speedup", "numpy ms", "stitched GB/s", "of copy BW",
              "max abs err default", "max abs err stitched", "stitched correct")
    has_gpu = any(not math.isnan(r.gpu_ms_default) for r in rows)
    has_torch = any(not math.isnan(r.torch_eager_ms) for r in rows)
    if has_gpu:
        header += ("GPU ms default", "GPU ms stitched")
    if has_torch:
        header += ("torch eager ms", "torch.compile ms", "torch.compile ms / stitched ms")
    lines = [header]
    for r in rows:
        line = (r.graph, r.dtype, r.shape, f"{r.launches_default} -> {r.launches_stitched}",
                f"{r.mb_default:.1f} -> {r.mb_stitched:.1f} / {r.mb_ideal:.1f}",
                f"{r.cpu_ms_default:.3f}", f"{r.cpu_ms_stitched:.3f}", f"{r.speedup:.2f}x", f"{r.numpy_ms:.3f}",
                f"{r.gbps_stitched:.1f}", f"{100 * r.copy_fraction:.0f}%",
                f"{r.default_error:.1e}", f"{r.max_error:.1e}", "yes" if r.agree else "NO")
        if has_gpu:
            line += (f"{r.gpu_ms_default:.4f}", f"{r.gpu_ms_stitched:.4f}")
        if has_torch:
            line += (f"{r.torch_eager_ms:.3f}", f"{r.torch_compile_ms:.3f}", f"{r.vs_torch_compile:.2f}x")
        lines.append(line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if rows:
        ld = sum(r.launches_default for r in rows)
        ls = sum(r.launches_stitched for r in rows)
        md = sum(r.mb_default for r in rows)
        ms = sum(r.mb_stitched for r in rows)
        out.append("")
        out.append(f"copy bandwidth of this machine, measured in the same run: {rows[0].copy_gbps:.1f} GB/s")
        if has_torch:
            valid = [r for r in rows if not math.isnan(r.torch_compile_ms)]
            out.append(f"CPU geomean of torch.compile time / tvm-stitch time: "
                       f"{geomean([r.vs_torch_compile for r in valid]):.2f}x over {len(valid)} graphs "
                       "(above 1: tvm-stitch faster)")
        out.append(f"CPU geomean speedup {geomean([r.speedup for r in rows]):.2f}x over TVM's default pipeline "
                   f"(llvm); CUDA launches {ld} -> {ls} ({100.0 * (ld - ls) / ld:.0f}% fewer); "
                   f"modeled CUDA traffic {md:.0f} -> {ms:.0f} MB ({100.0 * (md - ms) / md:.0f}% less)")
    return "\n".join(out)


def write_json(rows: list, path: str, extra: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = dict(extra)
    data["rows"] = [dict(asdict(r), speedup=r.speedup, vs_torch_compile=r.vs_torch_compile,
                         gbps_stitched=r.gbps_stitched, copy_fraction=r.copy_fraction) for r in rows]
    with open(path, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=2, default=str)


def bench_metadata(size: str, dtype: str) -> dict:
    import tvm

    return {
        "machine": machine_name(),
        "target": str(host_target()),
        "date": time.strftime("%Y-%m-%d"),
        "tvm": tvm.__version__,
        "size": size,
        "dtype": dtype,
        "threads": cpu_threads(),
    }


def results_folder(root: str = "benchmarks/results", machine: str = "") -> str:
    """root/<machine>: the machine named by `machine`, else cpu-<cores>core."""
    return os.path.join(root, machine or f"cpu-{os.cpu_count()}core")


def save_results(folder: str, rows: list, model_rows: list, meta: dict, text: str) -> list:
    """<date>.json, <date>.md (the printed tables) and, with matplotlib, <date>-*.png; returns the paths."""
    from tvm_stitch.tools.plots import plot_results

    stem = os.path.join(folder, meta["date"])
    write_json(rows, stem + ".json", dict(meta, models=[asdict(r) for r in model_rows]))
    with open(stem + ".md", "w", encoding="utf-8") as out:
        out.write(f"# tvm-stitch bench, {meta['date']}\n\n```\n{meta['command']}\n```\n\n{text}\n")
    return [stem + ".json", stem + ".md"] + plot_results(rows, model_rows, stem)
