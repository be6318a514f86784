"""How well the shipped model chooses, on shapes it was not trained on.

Reads the held-out records of `tvm-stitch tune --shapes held-out` (every
candidate of every group timed in one run), and per group compares the
time of the model's choice and of the rule plan with the best measured
candidate. The model's choice is made exactly as at compile time: the
lowest prediction over the candidates in candidates.py's order, the rule
plan on ties, and the rule plan when the choice did not build. It also
compiles the suite with and without the model, alternating, for the
compile-time overhead, and times the whole suite at its bench shapes (the
graphs users run, larger than most training shapes) built both ways,
alternating: the guard for using the model by default. Writes
evaluation.json and evaluation.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from tvm_stitch.tools.bench import geomean
from tvm_stitch.planning.cost_model import load_model, model_path
from tvm_stitch.tools.tune import GRAPHS, HELD_OUT_SHAPES, REPEAT, machine, read_records

WITHIN = 1.10  # the model's choice counts as good within 10% of the best candidate
GOOD_SHARE = 0.80  # ... for at least this share of the held-out groups
RULE_SLACK = 1.05  # geomean of model / rules at most this
COMPILE_SLACK = 1.20  # compile time with the model / without, at most this
BENCH_WORST = 1.10  # at bench shapes no graph may run more than this slower with the model than with rules


def choices(records: list, model) -> list:
    """Per group: rule, model and best milliseconds, and the chosen knobs."""
    rows = []
    for record in records:
        entries = record["candidates"]
        timed = [e for e in entries if e["ms"] is not None and e["agrees"]]
        rule = next((e for e in entries if e["rule"]), None)
        if rule is None or rule["ms"] is None or len(timed) < 2:
            continue
        scores = model.costs([e["features"] for e in entries])
        pick = entries[min(range(len(entries)), key=lambda i: (scores[i], i))]
        if pick["ms"] is None or not pick["agrees"]:
            pick = rule  # as at compile time: a choice that does not build gives way to the rules
        best = min(e["ms"] for e in timed)
        rows.append({"group": record["group"], "ops": ",".join(record["ops"][:4]), "candidates": len(entries),
                     "best_ms": best, "rule_ms": rule["ms"], "model_ms": pick["ms"],
                     "model_knobs": pick["knobs"], "rule_knobs": rule["knobs"],
                     "model_over_best": pick["ms"] / best, "rule_over_best": rule["ms"] / best,
                     "model_over_rule": pick["ms"] / rule["ms"]})
    return rows


def compile_times(graphs: list, dims: dict, repeats: int = 2, progress=print) -> list:
    """Seconds to compile each suite graph (float32) with and without the model, alternating; min of repeats."""

    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.workloads import SUITE
    from tvm_stitch.target import host_target

    target = host_target()
    build(SUITE[graphs[0]].build("float32", dims), target, stitched=True)  # warm-up: caches, model load
    rows = []
    for name in graphs:
        mod = SUITE[name].build("float32", dims)
        times = {True: [], False: []}
        for _ in range(repeats):
            for with_model in (True, False):
                times[with_model].append(build(mod, target, stitched=True, cost_model=with_model).compile_seconds)
        rows.append({"graph": name, "with_model_s": min(times[True]), "rules_only_s": min(times[False])})
        progress(f"compile {name}: {rows[-1]['with_model_s']:.2f} s with the model, "
                 f"{rows[-1]['rules_only_s']:.2f} s rules only")
    return rows


def bench_times(graphs: list, rounds: int = 7, progress=print) -> list:
    """Each suite graph (float32, bench shapes) built with the model and with rules only, timed in
    alternating rounds; milliseconds are medians over the rounds. Where the model kept every
    rule plan the two builds are the same kernels: timed once, ratio 1."""
    from tvm_stitch.tools.build import alternating_times, build, vm_round
    from tvm_stitch.tools.workloads import SUITE, dims
    from tvm_stitch.target import host_target

    target = host_target()
    d = dims("bench")
    rows = []
    for name in graphs:
        graph = SUITE[name]
        mod = graph.build("float32", d)
        inputs = graph.inputs(np.random.default_rng(0), "float32", d)
        built = {with_model: build(mod, target, stitched=True, cost_model=with_model) for with_model in (True, False)}
        if built[True].report.plans == built[False].report.plans:
            # The model kept every rule plan: the same kernels, so no timing difference to measure.
            ms = alternating_times({False: vm_round(built[False].executable, inputs)}, rounds=rounds)
            row = {"graph": name, "model_ms": ms[False], "rules_ms": ms[False], "same_plans": True}
        else:
            ms = alternating_times({k: vm_round(b.executable, inputs) for k, b in built.items()}, rounds=rounds)
            row = {"graph": name, "model_ms": ms[True], "rules_ms": ms[False], "same_plans": False}
        row["model_over_rule"] = row["model_ms"] / row["rules_ms"]
        rows.append(row)
        progress(f"bench shape {name}: {row['model_ms']:.3f} ms with the model, {row['rules_ms']:.3f} ms rules "
                 f"({'same plans' if row['same_plans'] else format(row['model_over_rule'], '.2f') + 'x'})")
    return rows


def _quantiles(values: list) -> dict:
    q = np.quantile(values, [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]) if values else [float("nan")] * 6
    return dict(zip(("min", "p25", "median", "p75", "p90", "max"), (round(float(v), 3) for v in q)))


def evaluate(held_out: Path, out: Path, compile_graphs: bool = True, bench_graphs: bool = True,
             progress=print) -> dict:
    model = load_model("cpu")
    if model is None:
        raise FileNotFoundError(f"no usable CPU model at {model_path('cpu')}: run `tvm-stitch train`")
    records = [r for r in read_records(held_out) if "candidates" in r]
    if not records:
        raise FileNotFoundError(f"no held-out records in {held_out}: run `tvm-stitch tune --shapes held-out`")
    rows = choices(records, model)
    good = sum(1 for r in rows if r["model_over_best"] <= WITHIN)
    share = good / len(rows) if rows else 0.0
    vs_rule = geomean([r["model_over_rule"] for r in rows])
    summary = {
        "groups": len(rows),
        "share_within_10pct_of_best": round(share, 3),
        "geomean_model_over_rule": round(vs_rule, 4),
        "geomean_model_over_best": round(geomean([r["model_over_best"] for r in rows]), 4),
        "geomean_rule_over_best": round(geomean([r["rule_over_best"] for r in rows]), 4),
        "rule_within_10pct_of_best": round(sum(1 for r in rows if r["rule_over_best"] <= WITHIN) / max(1, len(rows)), 3),
        "model_over_best": _quantiles([r["model_over_best"] for r in rows]),
        "rule_over_best": _quantiles([r["rule_over_best"] for r in rows]),
    }
    done = share >= GOOD_SHARE and vs_rule <= RULE_SLACK
    compile_rows = []
    if compile_graphs:
        compile_rows = compile_times(GRAPHS, next(iter(HELD_OUT_SHAPES.values())), progress=progress)
        with_model = sum(r["with_model_s"] for r in compile_rows)
        rules_only = sum(r["rules_only_s"] for r in compile_rows)
        summary["compile_s_with_model"] = round(with_model, 2)
        summary["compile_s_rules_only"] = round(rules_only, 2)
        summary["compile_ratio"] = round(with_model / rules_only, 3)
        done = done and with_model / rules_only <= COMPILE_SLACK
    summary["done"] = done
    bench_rows = []
    if bench_graphs:
        from tvm_stitch.tools.workloads import SUITE

        bench_rows = bench_times(list(SUITE), progress=progress)
        ratios = [r["model_over_rule"] for r in bench_rows]
        summary["bench_geomean_model_over_rule"] = round(geomean(ratios), 4)
        summary["bench_worst_model_over_rule"] = round(max(ratios), 4)
        summary["bench_guard"] = max(ratios) <= BENCH_WORST and geomean(ratios) <= 1.0
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "held_out_records": str(held_out),
            "model": str(model_path("cpu")), "shapes": sorted({r["group"].split("/")[2] for r in records}),
            "rounds": sorted({r.get("rounds", REPEAT) for r in records})}
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").write_text(json.dumps({"meta": meta, "summary": summary, "groups": rows,
                                                     "compile": compile_rows, "bench": bench_rows},
                                                    indent=1) + "\n", encoding="utf-8")
    markdown = _markdown(meta, summary, rows, compile_rows, bench_rows)
    (out / "evaluation.md").write_text(markdown, encoding="utf-8")
    return {"summary": summary, "markdown": markdown, "done": done}


def _markdown(meta: dict, summary: dict, rows: list, compile_rows: list, bench_rows: list) -> str:
    lines = [
        "# Cost model evaluation (CPU, held-out shapes)",
        "",
        f"Machine: {meta['machine']}; {meta['date']}. Held-out shapes: {', '.join(meta['shapes'])} "
        f"(not in the training records). Every candidate of a group was timed in the same run "
        f"(TVM time evaluator, median of {'/'.join(map(str, meta['rounds']))} rounds visiting the candidates "
        f"in turn); ratios are to the "
        f"best candidate measured.",
        "",
        f"- groups: {summary['groups']}",
        f"- model's choice within 10% of the best: {summary['share_within_10pct_of_best']:.0%} of groups "
        f"(rules: {summary['rule_within_10pct_of_best']:.0%}); target: at least {GOOD_SHARE:.0%}",
        f"- geomean time, model / rules: {summary['geomean_model_over_rule']:.3f} (target: at most {RULE_SLACK}); "
        f"model / best {summary['geomean_model_over_best']:.3f}, rules / best {summary['geomean_rule_over_best']:.3f}",
        f"- distribution of model / best: {summary['model_over_best']}",
        f"- distribution of rules / best: {summary['rule_over_best']}",
    ]
    if compile_rows:
        lines.append(f"- compile time of the suite (float32), with the model / rules only: "
                     f"{summary['compile_s_with_model']} s / {summary['compile_s_rules_only']} s = "
                     f"{summary['compile_ratio']:.3f} (target: at most {COMPILE_SLACK})")
    lines.append(f"- done-when met: {summary['done']}")
    if bench_rows:
        lines.append(f"- suite at bench shapes (float32), model / rules: geomean "
                     f"{summary['bench_geomean_model_over_rule']:.3f}, worst {summary['bench_worst_model_over_rule']:.3f} "
                     f"(guard for the default: geomean at most 1, worst at most {BENCH_WORST}): "
                     f"{'met' if summary['bench_guard'] else 'NOT met'}")
    lines += ["", "| group | ops | candidates | best ms | rules / best | model / best | model knobs |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["model_knobs"]
        lines.append(f"| {r['group']} | {r['ops']} | {r['candidates']} | {r['best_ms']:.4f} | "
                     f"{r['rule_over_best']:.3f} | {r['model_over_best']:.3f} | "
                     f"rank {k['rank']}, threads {k['threads']}, vector {k['vector']} |")
    if compile_rows:
        lines += ["", "| graph | compile s with model | rules only |", "|---|---|---|"]
        lines += [f"| {r['graph']} | {r['with_model_s']:.2f} | {r['rules_only_s']:.2f} |" for r in compile_rows]
    if bench_rows:
        lines += ["", "| graph (bench shape, float32) | ms with model | ms rules | model / rules |", "|---|---|---|---|"]
        lines += [f"| {r['graph']} | {r['model_ms']:.3f} | {r['rules_ms']:.3f} | "
                  f"{'1 (same plans)' if r['same_plans'] else format(r['model_over_rule'], '.3f')} |"
                  for r in bench_rows]
    return "\n".join(lines) + "\n"
