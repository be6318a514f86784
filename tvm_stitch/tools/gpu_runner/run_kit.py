"""Run the GPU check kit: correctness and timings of TVM-default vs tvm-stitch kernels.

Runs from inside a pack made by `tvm-stitch gpu-kit` (the pack holds this
file, the exported libraries with sm_90a cubins, a runtime-only `tvm`, the
`apache-tvm-ffi` wheel for CPython 3.12, the suite's `workloads` package and
tolerance.py). Needs numpy; PyTorch for CUDA-event timing, the copy
bandwidth and the eager / torch.compile baselines. No compiler is needed.

    python3 run_kit.py --out $OUT                 # quick: correctness + TVM default vs stitched
    python3 run_kit.py --out $OUT --full          # also torch eager and torch.compile per shape
    python3 run_kit.py --out $OUT --sanitize      # compute-sanitizer memcheck + racecheck, one graph per scheme
    python3 run_kit.py --dry-run --out /tmp/r     # anywhere: the pack loads and the CPU build runs

On the device tool's machine only `$OUT` comes back: pass `--out $OUT`.
results.json and results.md (sanitize.json and sanitize.md with
--sanitize) are rewritten there after every graph, so a kill keeps what was
done. A failure is recorded per graph and per contender and the run goes
on; after an error that leaves the CUDA context unusable the runner starts
itself again (`--resume`) and carries on with the next graph. `--budget-s`
(default 420) stops starting new graphs once spent.

Timing: each contender call is bracketed by CUDA events on the default
stream (where TVM launches too), after a write of twice the L2 that flushes
it; the events exclude the flush. One measurement sums calls until at least
20 ms of bracketed time; rounds alternate default and stitched (order
reversed every round) after a warm-up; the median per-call time is kept.
TVM's time_evaluator was not used: its L2 flush (`cache_flush_bytes`, or
`f_preproc="l2_cache_flush_cuda"`) runs once per repeat, before `number`
back-to-back calls, so every call after the first finds a warm L2.
Achieved bandwidth counts each input read once and each output written
once, as a fraction of a device-to-device copy measured in the same run.

Per PrimFunc: after the timing rounds, five more calls of each TVM build
with CUDA events recorded around every PrimFunc call (the VM's instrument
hook), the L2 flushed before each call; the median per call is recorded
beside the time model's figure from the manifest (`<build>_primfunc_times`), and
calibration.jsonl holds one record per PrimFunc for `tvm-stitch calibrate`.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURE_MS = 20.0
MAX_RESTARTS = 3
SANITIZE_TOOLS = ("memcheck", "racecheck")
SANITIZE_FIRST = ("layernorm_softmax",)  # four chained row reductions staged in shared memory


# --- loading the pack ---------------------------------------------------------------

def _import_runtime():
    """Import the pack's runtime-only tvm (and tvm_ffi from its wheel when missing)."""
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"  # else tvm_ffi JIT-builds a torch extension at import
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        import zipfile

        target = "/tmp/tvm-stitch-kit-site"
        if not os.path.isdir(os.path.join(target, "tvm_ffi")):
            wheels = sorted(glob.glob(os.path.join(HERE, "wheels", "*.whl")))
            if not wheels:
                raise RuntimeError("no tvm_ffi importable and no apache-tvm-ffi wheel in the pack's wheels/")
            with zipfile.ZipFile(wheels[-1]) as wheel:  # a wheel is a zip of the installed files
                wheel.extractall(target)
        sys.path.insert(0, target)
    sys.path.insert(0, os.path.join(HERE, "site"))
    sys.path.insert(0, HERE)
    import tvm
    import tvm.runtime.vm  # noqa: F401 - the VirtualMachine wrapper, not imported by `tvm` itself

    return tvm


def _cudart_candidates() -> list:
    """PyTorch's own libcudart first (torch, imported later, then shares it), the loader's, CUDA's."""
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "**",
                                          "libcudart.so.13*"), recursive=True))
    found.append("libcudart.so.13")
    for pattern in ("/usr/local/cuda*/lib64/libcudart.so.13*", "/usr/local/cuda*/targets/*/lib/libcudart.so.13*"):
        found += sorted(glob.glob(pattern))
    return found


def _load_cuda_runtime(tvm) -> None:
    """Register TVM's CUDA module loader: libcudart.so.13 first, then libtvm_runtime_cuda.so."""
    import tvm_ffi

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    tried = []
    for path in _cudart_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as err:
            tried.append(f"{path}: {err}")
    else:
        raise RuntimeError("libcudart.so.13 not found; tried " + "; ".join(tried))
    ctypes.CDLL(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)


def _flatten(result) -> list:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [a for r in result for a in _flatten(r)]


def _agree(outs, refs, dtype) -> tuple:
    """(every output has its reference's shape and is within the tolerance table's bound, numpy's
    allclose rule, with NaN never passing; max absolute error), in one pass over each output."""
    import numpy as np

    from tolerance import tolerance

    rtol, atol = tolerance(dtype)
    if len(outs) != len(refs):
        return False, float("inf")
    ok, err = True, 0.0
    for out, ref in zip(outs, refs):
        if np.shape(out) != np.shape(ref):
            return False, float("inf")
        if not np.size(ref):
            continue
        diff = np.abs(np.asarray(out, np.float64) - ref)
        ok = ok and bool(np.all(diff <= atol + rtol * np.abs(ref)))
        worst = float(np.max(diff))
        err = worst if math.isnan(worst) or worst > err else err
    return ok, err


def _agree_relative(outs, refs, bound: float) -> tuple:
    """(every output has its reference's shape, and max |out - ref| / max |ref| over each output is at
    most `bound`, NaN never passing; that largest relative error): a model step against PyTorch float32
    eager, whose half-precision rounding compounds over layers beyond the element-wise table. An output
    whose largest magnitude is below 1e-6 of all outputs' is measured against the latter."""
    import numpy as np

    if len(outs) != len(refs) or any(np.shape(o) != np.shape(r) for o, r in zip(outs, refs)):
        return False, float("inf")
    scale = max((float(np.max(np.abs(r))) for r in refs if np.size(r)), default=0.0)
    worst = 0.0
    for out, ref in zip(outs, refs):
        if np.size(ref):
            own = float(np.max(np.abs(ref)))
            err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
            err /= (own if own >= 1e-6 * scale else scale) or 1.0
            worst = err if math.isnan(err) or err > worst else worst
    return bool(worst <= bound), worst


def _check(entry: dict, outs, refs) -> tuple:
    """(correct, error): a model step by relative error (`entry["rel_error"]`), a suite graph by the table."""
    if "rel_error" in entry:
        return _agree_relative(outs, refs, entry["rel_error"])
    return _agree(outs, refs, entry["dtype"])


def _data(entry: dict):
    """(inputs, float64 references) of an entry: a model step's from its data file, a suite graph's
    regenerated from its seed and dims."""
    import numpy as np

    if "data" in entry:
        with np.load(os.path.join(HERE, entry["data"])) as data:
            count = {kind: sum(1 for k in data.files if k.startswith(kind)) for kind in ("input_", "expected_")}
            return ([data[f"input_{i}"] for i in range(count["input_"])],
                    [data[f"expected_{i}"].astype(np.float64) for i in range(count["expected_"])])
    import workloads

    graph = workloads.graph(entry["graph"])
    inputs = graph.inputs(np.random.default_rng(entry["seed"]), entry["dtype"], entry["dims"])
    return inputs, workloads.reference(graph, inputs)


def _key(entry: dict) -> str:
    return f"{entry['name']}/{entry['dtype']}"


class Prefetch:
    """Inputs and numpy references made in worker processes, all submitted at once, largest first.

    numpy makes them on one core at about 10-60 s per GB of work; made one after the other, the
    HBM entries alone would take minutes while the GPU waits. Each entry is made once and kept
    until its last use in `order` (full mode uses it twice): at most every entry's data at once,
    about 12 GB for the whole kit. Workers are spawned, never forked from a process holding a CUDA
    context. An entry not in `order` is made in this process.
    """

    def __init__(self, load, order: list, workers: int):
        self.load, self.workers = load, workers
        self.uses: dict = {}
        self.entries: dict = {}
        for entry in order:
            self.uses[_key(entry)] = self.uses.get(_key(entry), 0) + 1
            self.entries[_key(entry)] = entry
        self.futures: dict = {}
        self.pool = None
        self._submit()

    def _submit(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        pending = [e for k, e in self.entries.items() if k not in self.futures and self.uses[k] > 0]
        for entry in sorted(pending, key=lambda e: -e.get("ideal_bytes", 0)):
            self.futures[_key(entry)] = self.pool.submit(self.load, entry)

    def __call__(self, entry: dict):
        from concurrent.futures.process import BrokenProcessPool

        key = _key(entry)
        if self.uses.get(key, 0) == 0:
            return self.load(entry)
        self.uses[key] -= 1
        future = self.futures[key] if self.uses[key] else self.futures.pop(key)
        try:
            return future.result()
        except BrokenProcessPool:  # a worker died (out of memory, say): make this one here, restart the rest
            self.close()
            self.futures = {k: f for k, f in self.futures.items() if f.done() and f.exception() is None}
            self._submit()
            return self.load(entry)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _short(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"


# --- contenders ---------------------------------------------------------------------

class TVMContender:
    """One exported library on a device: `run()` is one timed call, `outputs()` its numpy results."""

    def __init__(self, tvm, path: str, dev, inputs: list, allocator: str = "pooled"):
        lib = tvm.runtime.load_module(path)
        self.vm = tvm.runtime.vm.VirtualMachine(lib, dev, memory_cfg=allocator)
        self.main = self.vm["main"]
        self.args = [tvm.runtime.tensor(a, dev) for a in inputs]
        self.dev = dev

    def run(self):
        return self.main(*self.args)

    def outputs(self) -> list:
        out = _flatten(self.run())
        self.dev.sync()
        return out


class TorchContender:
    """A suite graph's PyTorch version (workloads), eager or through `torch.compile(dynamic=False)` after a dynamo reset
    (a fresh compile for every shape)."""

    def __init__(self, graph: str, inputs: list, compiled: bool):
        import torch
        import workloads

        base = workloads.graph(graph).torch
        self.args = [torch.from_numpy(a).cuda() for a in inputs]
        if compiled:
            torch._dynamo.reset()  # noqa: SLF001 - no cache or recompile limit shared between shapes

            def fresh(*args):
                return base(*args)

            self.fn = torch.compile(fresh, dynamic=False)
        else:
            self.fn = base
        started = time.perf_counter()
        self.fn(*self.args)
        torch.cuda.synchronize()
        self.first_call_s = time.perf_counter() - started

    def run(self):
        return self.fn(*self.args)

    def outputs(self) -> list:
        out = self.run()
        out = out if isinstance(out, (tuple, list)) else [out]
        return [o.detach().float().cpu().numpy() if o.dtype.is_floating_point else o.cpu().numpy() for o in out]


# --- timing ---------------------------------------------------------------------------

class CudaTimer:
    """Per-call device time with CUDA events around each call, the L2 flushed before each."""

    def __init__(self, l2_bytes: int, min_ms: float = MEASURE_MS):
        try:
            import torch
        except ImportError as err:
            raise RuntimeError("timing needs PyTorch (CUDA events); --once checks correctness without it") from err

        self.torch = torch
        self.flush_buffer = torch.empty(max(2 * l2_bytes, 1 << 20) // 4, dtype=torch.float32, device="cuda")
        self.min_ms = min_ms

    def measure(self, run, calls: int) -> tuple:
        """(total bracketed ms, calls) over `calls` calls of `run`."""
        torch = self.torch
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in pairs:
            self.flush_buffer.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in pairs), calls

    def calls_for(self, run) -> int:
        """Calls needed for at least `min_ms` of bracketed time, from a 3-call estimate."""
        total, calls = self.measure(run, 3)
        return max(1, min(20000, math.ceil(self.min_ms * calls / max(total, 1e-4))))


def alternate(runs: dict, timer, rounds: int) -> tuple:
    """({name: median ms per call}, {name: error}): after a warm-up measurement of each, `rounds`
    rounds in alternating order; a contender that raises is dropped and its error returned."""
    times: dict = {name: [] for name in runs}
    errors: dict = {}
    calls: dict = {}
    for name, run in runs.items():
        try:
            calls[name] = timer.calls_for(run)
            timer.measure(run, calls[name])
        except Exception as err:  # noqa: BLE001 - recorded per contender
            errors[name] = _short(err)
    names = [n for n in runs if n not in errors]
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if name in errors:
                continue
            try:
                total, n = timer.measure(runs[name], calls[name])
                times[name].append(total / n)
            except Exception as err:  # noqa: BLE001
                errors[name] = _short(err)
    medians = {n: float(statistics.median(t)) for n, t in times.items() if t and n not in errors}
    return medians, errors


def copy_bandwidth(timer) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s)."""
    torch = timer.torch
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    run = lambda: dst.copy_(src)  # noqa: E731
    run()
    total, calls = timer.measure(run, max(timer.calls_for(run), 10))
    del src, dst
    torch.cuda.empty_cache()  # give the 2 GiB back: TVM allocates outside torch's cache
    return 2 * (1 << 28) * 4 / (total / calls * 1e-3) / 1e9


# --- one graph ---------------------------------------------------------------------

def run_graph(row: dict, entry: dict, contenders: dict, load_data, timer, rounds: int, budget_left) -> bool:
    """Check and time `contenders` ({name: make(entry, inputs) -> contender}) on one entry, writing
    results into `row`. Returns whether some contender raised."""
    failed = False
    inputs, refs = load_data(entry)
    ready = {}
    for name, make in contenders.items():
        if budget_left() <= 0:
            row[f"{name}_skipped"] = "budget spent"
            continue
        try:
            contender = make(entry, inputs)
            row[f"{name}_correct"], row[f"{name}_max_error"] = _check(entry, contender.outputs(), refs)
            if hasattr(contender, "first_call_s"):
                row[f"{name}_first_call_s"] = contender.first_call_s
            ready[name] = contender
        except Exception as err:  # noqa: BLE001 - a failing contender is a result, not a crash
            row[f"{name}_error"] = _short(err)
            failed = True
    if timer is not None and ready:
        medians, errors = alternate({n: c.run for n, c in ready.items()}, timer, rounds)
        for name, ms in medians.items():
            row[f"{name}_ms"] = ms
            row[f"{name}_gbs"] = entry["ideal_bytes"] / (ms * 1e-3) / 1e9
        for name, err in errors.items():
            row[f"{name}_error"] = err
            failed = True
        if "default_ms" in row and "stitched_ms" in row:
            row["speedup"] = row["default_ms"] / row["stitched_ms"]
        for name, contender in ready.items():
            modeled = entry.get(f"modeled_{name}")
            if modeled and hasattr(contender, "vm") and name not in errors:
                try:
                    row[f"{name}_primfunc_times"] = kernel_records(contender, modeled, timer)
                except Exception as err:  # noqa: BLE001 - the graph's timings stand without them
                    row[f"{name}_primfunc_times_error"] = _short(err)
    return failed


# --- per-PrimFunc times, for calibrating the time model ----------------------------------

class CallTimes:
    """Device time of each PrimFunc call of a VM: an event recorded before and after every call
    of one of `names` (the VM's instrument hook, called around each Call instruction)."""

    def __init__(self, vm, names, event, elapsed_ms):
        self.names, self.event, self.elapsed_ms = set(names), event, elapsed_ms
        self.marks: list = []
        vm.set_instrument(self._instrument)

    def _instrument(self, func, symbol, before_run, ret_value, *args):
        if symbol in self.names:
            self.marks.append((symbol, before_run, self.event()))
        return 0  # VMInstrumentReturnKind.NO_OP: run the call

    def per_call_us(self) -> dict:
        """{name: microseconds per call} over the calls marked since the last reading."""
        total: dict = {}
        calls: dict = {}
        open_marks: dict = {}
        for symbol, before_run, event in self.marks:
            if before_run:
                open_marks[symbol] = event
            elif symbol in open_marks:
                total[symbol] = total.get(symbol, 0.0) + 1e3 * self.elapsed_ms(open_marks.pop(symbol), event)
                calls[symbol] = calls.get(symbol, 0) + 1
        self.marks = []
        return {name: total[name] / calls[name] for name in total}


def kernel_records(contender, modeled: dict, timer, runs: int = 5) -> dict:
    """{PrimFunc: its median measured and its modeled microseconds per call, and its kernels'
    geometry}: `runs` calls of the contender, the L2 flushed before each (`timer`'s buffer)."""
    torch = timer.torch
    times = CallTimes(contender.vm, modeled, lambda: _recorded(torch), lambda a, b: a.elapsed_time(b))
    samples: dict = {}
    for _ in range(runs):
        timer.flush_buffer.zero_()
        contender.run()
        torch.cuda.synchronize()
        for name, us in times.per_call_us().items():
            samples.setdefault(name, []).append(us)
    return {name: {"measured_us": float(statistics.median(us)), "modeled_us": modeled[name]["modeled_us"],
                   "kernels": modeled[name]["kernels"]} for name, us in samples.items()}


def _recorded(torch):
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def calibration_records(header: dict, rows: list) -> list:
    """One record per measured PrimFunc of each build (`tvm-stitch calibrate` reads them)."""
    records = []
    for row in rows:
        for build in ("default", "stitched"):
            for name, kernel in row.get(f"{build}_primfunc_times", {}).items():
                records.append({"arch": header.get("plan_arch", "sm_90"), "device": header.get("gpu", ""),
                                "entry": row["key"], "build": build, "name": name, **kernel})
    return records


def run_passes(state: dict, entries: list, passes: list, out: str, budget_s: float, load_data, timer, rounds: int,
               alive=lambda: True, clock=time.time) -> bool:
    """Run every pass ((name, contenders)) over every entry, writing results after each graph.
    Returns False when a failure left the device unusable (`alive()` false): restart and resume."""
    rows = state["rows"]
    write_results(out, state)
    for pass_name, contenders in passes:
        for entry in entries:
            key = _key(entry)
            row = rows.setdefault(key, _base_row(entry))
            if pass_name in row["passes"]:
                continue
            if pass_name == "torch" and "model" in entry:
                row["torch_skipped"] = "a model step: the kit holds no PyTorch version of the model"
                row["passes"].append(pass_name)
                continue
            if clock() - state["header"]["started"] >= budget_s:
                state["header"]["skipped_for_budget"].append(f"{pass_name}: {key}")
                row["passes"].append(pass_name)
                continue
            started = clock()
            try:
                failed = run_graph(row, entry, contenders, load_data, timer, rounds,
                                   lambda: budget_s - (clock() - state["header"]["started"]))
            except Exception as err:  # noqa: BLE001 - a failing graph is recorded; the others go on
                row[f"{pass_name}_error"] = _short(err)
                row[f"{pass_name}_traceback"] = traceback.format_exc()[-1500:]
                failed = True
            row["passes"].append(pass_name)
            row[f"{pass_name}_seconds"] = clock() - started
            state["header"]["seconds"] = clock() - state["header"]["started"]
            write_results(out, state)
            _print_row(key, row)
            if failed and not alive():
                state["header"]["restart_after"] = key
                write_results(out, state)
                return False
    return True


def _base_row(entry: dict) -> dict:
    keep = ("name", "graph", "dtype", "dims", "ideal_bytes", "launches_default", "launches_stitched",
            "modeled_bytes_default", "modeled_bytes_stitched", "schemes_stitched")
    return {"key": _key(entry), **{k: entry[k] for k in keep if k in entry}, "passes": []}


def _print_row(key: str, row: dict) -> None:
    parts = [key]
    for name in ("default", "stitched", "torch_eager", "torch_compile"):
        if f"{name}_error" in row:
            parts.append(f"{name} ERROR {row[f'{name}_error'][:120]}")
        elif f"{name}_correct" in row:
            ms = f" {row[f'{name}_ms']:.4g} ms" if f"{name}_ms" in row else ""
            parts.append(f"{name} {'ok' if row[f'{name}_correct'] else 'WRONG'}{ms}")
    if "speedup" in row:
        parts.append(f"{row['speedup']:.2f}x")
    print(" | ".join(parts), flush=True)


# --- writing results ---------------------------------------------------------------------

def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_results(out: str, state: dict, stem: str = "results") -> None:
    """results.json (everything) and results.md (tables) under `out`, replaced atomically."""
    header, rows = state["header"], list(state["rows"].values())
    copy = header.get("copy_bandwidth_gbs")
    for row in rows:
        for name in ("default", "stitched", "torch_eager", "torch_compile"):
            if copy and f"{name}_gbs" in row:
                row[f"{name}_fraction_of_copy"] = row[f"{name}_gbs"] / copy
    _write_atomic(os.path.join(out, f"{stem}.json"), json.dumps({"header": header, "rows": rows}, indent=1))
    records = calibration_records(header, rows)
    if records:
        _write_atomic(os.path.join(out, "calibration.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    _write_atomic(os.path.join(out, f"{stem}.md"), markdown(header, rows))


_MAIN_COLS = ["name", "dtype", "ideal_bytes", "launches_default", "launches_stitched", "default_correct",
              "stitched_correct", "default_ms", "stitched_ms", "speedup", "default_fraction_of_copy",
              "stitched_fraction_of_copy"]
_TORCH_COLS = ["name", "dtype", "stitched_ms", "torch_eager_correct", "torch_eager_ms", "torch_compile_correct",
               "torch_compile_ms", "torch_compile_first_call_s"]


def markdown(header: dict, rows: list) -> str:
    lines = [f"# tvm-stitch GPU kit: {header.get('mode', '')} ({header.get('gpu', '')}, {header.get('date', '')})",
             "", "```", json.dumps(header, indent=1), "```", ""]
    if rows and "tool" in rows[0]:
        return "\n".join(lines + _table(["name", "dtype", "tool", "exit", "summary", "stitched_correct", "seconds",
                                          "error"], rows)) + "\n"
    if rows:
        lines += _table(_MAIN_COLS, rows)
    if any("torch_eager_correct" in r or "torch_eager_error" in r for r in rows):
        lines += ["", "## PyTorch", ""] + _table(_TORCH_COLS, rows)
    kernels = [{"name": r["name"], "dtype": r["dtype"], "kernel": k, **v}
               for r in rows for k, v in r.get("kernels_stitched", {}).items()]
    if kernels:
        lines += ["", "## Stitched kernels (ptxas, build time)", ""]
        lines += _table(["name", "dtype", "kernel", "registers", "shared_bytes", "stack_bytes",
                         "spill_store_bytes", "barriers"], kernels)
    errors = [(r["name"], r["dtype"], k, v) for r in rows for k, v in r.items()
              if (k.endswith("_error") and not k.endswith("_max_error")) or k.endswith("_skipped")]
    if errors:
        lines += ["", "## Failures and skips", ""] + [f"- {n} {d} {k}: {v}" for n, d, k, v in errors]
    return "\n".join(lines) + "\n"


def _table(cols: list, rows: list) -> list:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# --- the device --------------------------------------------------------------------------

def device_info() -> dict:
    """GPU name, SMs, L2, memory, driver and clocks (nvidia-smi), CUDA versions."""
    info: dict = {}
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, total_memory_bytes=props.total_memory,
                    compute_capability=f"{props.major}.{props.minor}", torch=torch.__version__,
                    torch_cuda=torch.version.cuda, l2_bytes=getattr(props, "L2_cache_size", 0))
    except Exception as err:  # noqa: BLE001
        info["torch_error"] = _short(err)
    query = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        info["nvidia_smi"] = dict(zip(query.split(","), (v.strip() for v in done.stdout.split(","))))
    except (OSError, subprocess.TimeoutExpired) as err:
        info["nvidia_smi_error"] = _short(err)
    return info


def _torch_alive() -> bool:
    """Whether the CUDA context still works after a failure (a sticky error poisons it)."""
    try:
        import torch

        return float(torch.ones(1, device="cuda").add_(1).item()) == 2.0
    except Exception:  # noqa: BLE001
        return False


# --- modes ---------------------------------------------------------------------------------

def _select(manifest: dict, args) -> list:
    only = set(args.only.split(",")) if args.only else None
    dtypes = set(args.dtype.split(",")) if args.dtype else None
    return [e for e in manifest["entries"]
            if (not only or e["name"] in only or e["graph"] in only) and (not dtypes or e["dtype"] in dtypes)]


def _new_state(mode: str) -> dict:
    return {"header": {"mode": mode, "date": time.strftime("%Y-%m-%d"), "started": time.time(), "restarts": 0,
                       "skipped_for_budget": []}, "rows": {}}


def _load_state(out: str, stem: str, mode: str, resume: bool) -> dict:
    path = os.path.join(out, f"{stem}.json")
    if resume and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        state = {"header": saved["header"], "rows": {r["key"]: r for r in saved["rows"]}}
        state["header"]["restarts"] += 1
        return state
    return _new_state(mode)


def run_gpu(manifest: dict, args) -> int:
    tvm = _import_runtime()
    _load_cuda_runtime(tvm)
    dev = tvm.cuda(0)
    mode = "once" if args.once else ("full" if args.full else "quick")
    state = _load_state(args.out, "results", mode, args.resume)
    header = state["header"]
    entries = _select(manifest, args)
    builds = args.builds.split(",")

    def tvm_maker(build):
        return lambda entry, inputs: TVMContender(tvm, os.path.join(HERE, entry[build]), dev, inputs, args.allocator)

    passes = [("tvm", {b: tvm_maker(b) for b in builds})]
    timer = None
    if not args.once:
        header.setdefault("device", device_info())
        header.setdefault("gpu", header["device"].get("gpu", ""))
        try:
            timer = CudaTimer(header["device"].get("l2_bytes") or (60 << 20))
            if "copy_bandwidth_gbs" not in header:
                header["copy_bandwidth_gbs"] = copy_bandwidth(timer)
        except Exception as err:  # noqa: BLE001 - without timings the correctness checks still run
            header["timing_error"] = _short(err)
        header["timing"] = (f"CUDA events per call, L2 flushed before each call, >= {MEASURE_MS} ms per measurement, "
                            f"{args.rounds} alternating rounds after a warm-up, median")
        if args.full:
            passes.append(("torch", {
                "torch_eager": lambda entry, inputs: TorchContender(entry["graph"], inputs, compiled=False),
                "torch_compile": lambda entry, inputs: TorchContender(entry["graph"], inputs, compiled=True)}))
    header["allocator"] = args.allocator
    header["plan_arch"] = manifest.get("plan_arch", "sm_90")
    header["build_warnings"] = manifest.get("warnings", [])
    header["kernel_resources"] = "registers and static shared memory from ptxas -v at build time (manifest)"
    for entry in entries:
        state["rows"].setdefault(_key(entry), _base_row(entry))["kernels_stitched"] = \
            entry.get("kernels_stitched", {})
    order = [e for name, _ in passes for e in entries if name not in state["rows"][_key(e)]["passes"]]
    prefetch = Prefetch(_data, order, args.workers)
    try:
        finished = run_passes(state, entries, passes, args.out, args.budget_s, prefetch, timer, args.rounds,
                              alive=_torch_alive if not args.once else (lambda: True))
    finally:
        prefetch.close()
    if not args.once:
        header["device_after"] = device_info().get("nvidia_smi", {})
        write_results(args.out, state)
    if not finished and header["restarts"] < MAX_RESTARTS:
        argv = [a for a in sys.argv[1:] if a != "--resume"] + ["--resume"]
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv])
    rows = state["rows"].values()
    return 0 if finished and all(r.get("stitched_correct", False) for r in rows if "stitched" in builds) else 1


def sanitize(manifest: dict, args) -> int:
    """compute-sanitizer memcheck and racecheck on the stitched build of one graph per scheme
    (`SANITIZE_FIRST` where it uses the scheme, else the smallest float32 entry using it), with
    TVM's naive allocator so that out-of-bounds accesses and use-after-free are not hidden inside
    pooled blocks."""
    state = _load_state(args.out, "sanitize", "sanitize", args.resume)
    header = state["header"]
    header.setdefault("device", device_info())
    header.setdefault("gpu", header["device"].get("gpu", ""))
    chosen: dict = {}
    order = sorted(manifest["entries"], key=lambda e: (e["name"] not in SANITIZE_FIRST, e["dtype"] != "float32",
                                                        e["ideal_bytes"]))
    for entry in order:
        for scheme in entry.get("schemes_stitched", []):
            chosen.setdefault(scheme, entry)
    for scheme, entry in chosen.items():
        for tool in SANITIZE_TOOLS:
            key = f"{scheme}/{tool}"
            if key in state["rows"]:
                continue
            left = args.sanitize_budget_s - (time.time() - header["started"])
            if left < 20:
                header["skipped_for_budget"].append(key)
                continue
            state["rows"][key] = _sanitize_one(scheme, entry, tool, min(left, args.sanitize_timeout_s))
            write_results(args.out, state, "sanitize")
            print(json.dumps(state["rows"][key]), flush=True)
    header["seconds"] = time.time() - header["started"]
    write_results(args.out, state, "sanitize")
    return 0 if all(r.get("exit") == 0 for r in state["rows"].values()) else 1


def _sanitize_one(scheme: str, entry: dict, tool: str, timeout: float) -> dict:
    row = {"key": f"{scheme}/{tool}", "name": f"{scheme}: {entry['name']}", "dtype": entry["dtype"], "tool": tool}
    out = f"/tmp/tvm-stitch-sanitize-{tool}"
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", sys.executable, os.path.abspath(__file__),
           "--out", out, "--only", entry["name"], "--dtype", entry["dtype"], "--once", "--builds", "stitched",
           "--allocator", "naive", "--workers", "1"]
    if os.path.exists(os.path.join(out, "results.json")):
        os.remove(os.path.join(out, "results.json"))
    started = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text = done.stdout + done.stderr
        summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
        problems = [line for line in text.splitlines() if line.startswith("========= ") and "SUMMARY" not in line]
        row.update(exit=done.returncode, summary=summary[-1] if summary else "", first_reports=problems[:12])
        if done.returncode != 0:
            row["output_tail"] = text[-2000:]
        with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
            checked = json.load(f)["rows"]
        row["stitched_correct"] = bool(checked) and all(r.get("stitched_correct", False) for r in checked)
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as err:
        row["error"] = _short(err)
    row["seconds"] = time.time() - started
    return row


def dry_run(manifest: dict, out: str) -> int:
    """On any machine: every library is in the pack, inputs and references regenerate, the CPU build runs."""
    tvm = _import_runtime()
    missing = [e[k] for e in manifest["entries"] for k in ("default", "stitched")
               if not os.path.exists(os.path.join(HERE, e[k]))]
    dry = manifest["dry_run"]
    contender = TVMContender(tvm, os.path.join(HERE, dry["library"]), tvm.cpu(), _data(dry)[0])
    ok, err = _agree(contender.outputs(), _data(dry)[1], dry["dtype"])
    for entry in manifest["entries"]:
        _data(dict(entry, dims=dry["dims"]))
    header = {"mode": "dry-run", "missing_libraries": missing, "cpu_build_correct": ok, "cpu_build_max_error": err,
              "entries": len(manifest["entries"])}
    write_results(out, {"header": header, "rows": {}})
    print(json.dumps(header))
    return 0 if ok and not missing else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results (on the device tool's machine: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the pack loads and the CPU build runs")
    parser.add_argument("--full", action="store_true", help="also torch eager and torch.compile per shape")
    parser.add_argument("--sanitize", action="store_true", help="compute-sanitizer memcheck + racecheck only")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no new graph starts after this (seconds)")
    parser.add_argument("--sanitize-budget-s", type=float, default=420.0)
    parser.add_argument("--sanitize-timeout-s", type=float, default=150.0, help="per compute-sanitizer child")
    parser.add_argument("--only", default="", help="comma-separated entry or graph names")
    parser.add_argument("--dtype", default="", help="comma-separated dtypes")
    parser.add_argument("--builds", default="default,stitched")
    parser.add_argument("--once", action="store_true", help="check each build once, no timing, no torch")
    parser.add_argument("--allocator", choices=["pooled", "naive"], default="pooled", help="TVM's VM allocator")
    parser.add_argument("--rounds", type=int, default=4, help="alternating timing rounds")
    parser.add_argument("--resume", action="store_true", help="continue the results already in --out")
    parser.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 4)),
                        help="processes making inputs and numpy references ahead")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(HERE, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    if args.dry_run:
        return dry_run(manifest, args.out)
    stem = "sanitize" if args.sanitize else "results"
    try:
        return sanitize(manifest, args) if args.sanitize else run_gpu(manifest, args)
    except Exception as err:
        record_crash(args.out, stem, err)
        raise


def record_crash(out: str, stem: str, err: BaseException) -> None:
    """Put an error that ended the run into the header of the results in `out` (made if none), so
    that it comes back with them."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    state = _new_state(stem)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        state = {"header": saved["header"], "rows": {r["key"]: r for r in saved["rows"]}}
    state["header"]["crash"] = _short(err)
    state["header"]["crash_traceback"] = traceback.format_exc()[-3000:]
    write_results(out, state, stem)


if __name__ == "__main__":
    sys.exit(main())
