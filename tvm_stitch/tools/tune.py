"""Measured candidates: every configuration of every stitched group of the suite, timed.

`tvm-stitch tune` compiles each suite graph at several shapes up to the
stitch pass, takes each stitched group's fused PrimFunc and rule plan,
schedules and builds every candidate (candidates.py) as a kernel on its
own, checks its outputs against the rule plan's kernel on the same inputs,
and times it (TVM's time evaluator, median of repeats). One JSON line per
group; a run resumes where a previous one stopped (groups already in the
file are skipped). Training shapes and held-out shapes are disjoint: the
model is evaluated (evaluate.py) only on shapes it never saw.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import s_tir, tirx

from schedules import schedule_for

from tvm_stitch.errors import UserInputError
from tvm_stitch.tools.build import alternating_times
from tvm_stitch.planning.candidates import candidates, knobs
from tvm_stitch.planning.features import features, group_facts
from tvm_stitch.pipeline import grouping_passes
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.stitch import stitch_module
from tvm_stitch.tools.workloads import SUITE, VARIANTS
from tvm_stitch.tools.tolerance import tolerance
from tvm_stitch.threads import cpu_threads
from tvm_stitch.analysis.tir_view import block_views

_BASE = {"batch": 8, "heads": 12, "seq": 128}
TRAIN_SHAPES = {
    "r256c256": dict(_BASE, rows=256, cols=256, vocab=2048, batch=2, heads=4, seq=64),
    "r2048c768": dict(_BASE, rows=2048, cols=768, vocab=8192),
    "r8192c128": dict(_BASE, rows=8192, cols=128, vocab=1024, batch=16, seq=32),
    "r64c4096": dict(_BASE, rows=64, cols=4096, vocab=32768, batch=1, heads=4, seq=256),
    "r512c2048": dict(_BASE, rows=512, cols=2048, vocab=4096, batch=4, heads=8, seq=192),
    "r4096c48": dict(_BASE, rows=4096, cols=48, vocab=512, batch=32, heads=2, seq=16),
    # rows that half, full or double vector widths do not divide
    "r1536c200": dict(_BASE, rows=1536, cols=200, vocab=1800, batch=6, heads=5, seq=40),
    "r768c100": dict(_BASE, rows=768, cols=100, vocab=900, batch=3, heads=10, seq=36),
    # the size of a BERT-base layer: large enough that threads and cache matter
    "r4096c768": dict(_BASE, rows=4096, cols=768, vocab=8192),
}
HELD_OUT_SHAPES = {
    "r1000c1000": dict(_BASE, rows=1000, cols=1000, vocab=5000, batch=4, heads=6, seq=96),
    "r3072c320": dict(_BASE, rows=3072, cols=320, vocab=3000, batch=16, heads=4, seq=64),
    "r160c1536": dict(_BASE, rows=160, cols=1536, vocab=12000, batch=2, heads=16, seq=160),
}
GRAPHS = tuple(name for name in SUITE if name not in VARIANTS)  # shape variants come from the shape sets here
MAX_GROUPS = 3  # groups measured per graph instance (Adam's twelve differ only in shape)
MAX_INPUT_BYTES = 256 << 20  # larger graph instances are skipped (e.g. Adam at a wide shape)
REPEAT = 10  # timing rounds per candidate (the median is kept)
REPEAT_MS = 5.0  # each round runs a candidate for about this long


def fused_groups(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    """(fused PrimFunc, rule plan) of each stitched group of `mod`, in order, without duplicates."""
    with target:
        lowered = tvm.transform.Sequential(grouping_passes(target))(mod)
    groups = []

    def collect(fused, rule, _spec, _prices):
        groups.append((fused, rule))
        return rule

    stitch_module(lowered, target, choose=collect)
    return groups


def _input_bytes(mod: tvm.IRModule) -> int:
    total = 0
    for param in mod["main"].params:
        shape = [int(d) for d in param.ty.shape]
        total += int(np.prod(shape)) * max(1, tvm.DataType(param.ty.dtype).bits // 8)
    return total


def _arrays(func: tirx.PrimFunc, rng) -> tuple:
    """Random inputs in [0.1, 1) (valid for sqrt, log, rsqrt; 0 for integer indices), zeroed outputs."""
    written = {w.buffer.name for view in block_views(s_tir.Schedule(func)) for w in view.writes}
    args, outputs = [], []
    for param in func.params:
        buffer = param
        shape = [int(d) for d in buffer.shape]
        dtype = str(buffer.dtype)
        if buffer.name in written:
            outputs.append(len(args))
            args.append(np.zeros(shape, dtype=dtype))
        elif "int" in dtype:
            args.append(np.zeros(shape, dtype=dtype))
        else:
            args.append(rng.uniform(0.1, 1.0, size=shape).astype(dtype))
    return args, outputs


def _build(func: tirx.PrimFunc, target: tvm.target.Target):
    name = "tuned_kernel"
    lib = tvm.tirx.build(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)
    return lib, name


def _agrees(got: list, want: list, dtype: str) -> bool:
    rtol, atol = tolerance(dtype)
    return all(np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
               for g, w in zip(got, want))


def measure_group(fused: tirx.PrimFunc, rule, target: tvm.target.Target, seed: int = 0,
                  repeat: int = REPEAT, repeat_ms: float = REPEAT_MS) -> list:
    """One entry per candidate: knobs, features, median ms, and whether it matches the rule plan's kernel.

    Every candidate is built and run once (its outputs checked against the
    rule plan's), then timed by `alternating_times` in `repeat` rounds that
    visit the candidates in turn, each run often enough to last about
    `repeat_ms`: a change of load on a shared machine then touches every
    candidate alike.
    """
    facts = group_facts(fused)
    arrays, outputs = _arrays(fused, np.random.default_rng(seed))
    dtype = str(fused.params[outputs[0] if outputs else -1].dtype)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]  # shared: every candidate writes all of its outputs
    entries, timers, reference = [], [], None
    for plan in candidates(fused, rule, rule.spec):
        entry = {"knobs": knobs(plan), "features": features(facts, plan, rule), "rule": plan is rule}
        entries.append(entry)
        try:
            lib, name = _build(schedule_for(fused, plan, target).mod["main"], target)
            start = time.perf_counter()
            lib[name](*args)
            once_ms = (time.perf_counter() - start) * 1e3
        except Exception as err:  # noqa: BLE001 - a candidate that fails is recorded, never picked
            entry.update(ms=None, agrees=False, error=f"{type(err).__name__}: {str(err)[-200:]}")
            continue
        got = [args[i].numpy() for i in outputs]
        if reference is None:
            reference = got
        entry["agrees"] = _agrees(got, reference, dtype)
        number = max(1, min(1000, int(repeat_ms / max(once_ms, 1e-3))))
        timer = lib.time_evaluator(name, dev, number=number, repeat=1)
        timers.append((entry, lambda timer=timer: timer(*args).mean * 1e3))
    ms = alternating_times({k: one_round for k, (_, one_round) in enumerate(timers)}, rounds=repeat)
    for k, (entry, _) in enumerate(timers):
        entry["ms"] = ms[k]
    return entries


def read_records(path: Path) -> list:
    """Every line of a records file (groups, and markers of complete graph instances)."""
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserInputError(f"{path}, line {number}: not a JSON record ({err.msg})") from err
    return records


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {cpu_threads()} threads, {platform.node()}"


def tune(out: Path, shapes: dict, graphs: list, dtypes: tuple, target: tvm.target.Target,
         progress=print) -> dict:
    """Measure every group of every graph at every shape; append one line per new group to `out`."""
    done = {r["group"] for r in read_records(out)}
    summary_skipped = sum(1 for r in read_records(out) if "candidates" in r)
    out.parent.mkdir(parents=True, exist_ok=True)
    family = TargetSpec.from_target(target).family
    summary = {"measured": 0, "skipped": summary_skipped, "disagreeing": [], "failed": []}
    start = time.perf_counter()
    jobs = [(g, d, s) for s in shapes for g in graphs for d in dtypes if d in SUITE[g].dtypes]
    for n, (graph, dtype, shape) in enumerate(jobs, 1):
        mod = SUITE[graph].build(dtype, shapes[shape])
        if _input_bytes(mod) > MAX_INPUT_BYTES:
            progress(f"[{n}/{len(jobs)}] {graph} {dtype} {shape}: skipped (inputs over {MAX_INPUT_BYTES >> 20} MiB)")
            continue
        prefix = f"{graph}/{dtype}/{shape}"
        if prefix in done:
            continue  # every group of this graph instance is in the file
        for k, (fused, rule) in enumerate(fused_groups(mod, target)[:MAX_GROUPS]):
            group = f"{prefix}/{k}"
            if group in done:
                continue
            entries = measure_group(fused, rule, target, seed=k)
            record = {"group": group, "graph": graph, "dtype": dtype, "shape": shape, "dims": shapes[shape],
                      "target": family, "kernel": rule.kernel, "ops": list(rule.ops), "machine": machine(), "rounds": REPEAT,
                      "llvm": str(target),
                      "candidates": entries}
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            summary["measured"] += 1
            timed = [e for e in entries if e["ms"] is not None]
            summary["disagreeing"] += [group for e in entries if e["ms"] is not None and not e["agrees"]]
            summary["failed"] += [f"{group} {e['knobs']}: {e['error']}" for e in entries if e["ms"] is None]
            rule_ms = next((e["ms"] for e in entries if e["rule"]), None)
            best = min((e["ms"] for e in timed), default=float("nan"))
            progress(f"[{n}/{len(jobs)}] {group}: {len(entries)} candidates, best {best:.3f} ms, "
                     f"rules {rule_ms if rule_ms is None else round(rule_ms, 3)} ms "
                     f"({time.perf_counter() - start:.0f} s)")
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"group": prefix, "complete": True}) + "\n")
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary
