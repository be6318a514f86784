"""The `tvm-stitch` command: `bench` (the suite, default vs stitched), `explain` (plans), `simt` (CUDA
kernels run with SIMT semantics on the CPU), `fuzz`, `gpu-kit`, `tune`, `train`, `evaluate`, `torch-compile`
(eager, Inductor and backend="tvm_stitch" timed on real models), `calibrate` (the CUDA time model fitted to
GPU timings)."""

from __future__ import annotations

import sys

from tvm_stitch.tools.cli_errors import OneLineParser, at_least, one_line, run_command
from tvm_stitch.tools.paths import check_writable_file, check_writable_folder


def _bench(args) -> int:
    from tvm_stitch.tools.bench import bench_metadata, copy_bandwidth, format_table, results_folder, run_bench, save_results, write_json
    from tvm_stitch.tools.model_bench import format_models, run_models
    from tvm_stitch.tools.workloads import SUITE

    graphs = args.graphs.split(",") if args.graphs else list(SUITE)
    unknown = [g for g in graphs if g not in SUITE]
    if unknown:
        print(f"unknown graph(s): {', '.join(unknown)}; the suite has: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    models = _model_names(args.models)
    if models is None:
        return 2
    from tvm_stitch.tools.model_bench import STEPS

    bad_steps = [s for s in args.steps.split(",") if s not in STEPS]
    if bad_steps:
        print(f"unknown step(s): {', '.join(bad_steps)}; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if args.json:
        check_writable_file(args.json, "--json", makes_folders=True)
    if args.results != "none":
        check_writable_folder(results_folder(args.results, args.machine), "--results")
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s", file=sys.stderr, flush=True)
    rows = []
    for dtype in args.dtype.split(","):
        rows += run_bench(graphs, dtype=dtype, size=args.size, target=args.target, with_torch=args.torch,
                          copy_gbps=copy_gbps)
    meta = bench_metadata(args.size, args.dtype)
    meta["model_size"] = args.model_size or args.size
    meta["command"] = "tvm-stitch " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    lines = [f"tvm-stitch bench on {meta['machine']} (TVM {meta['tvm']}, target {meta['target']}, "
             f"{meta['threads']} threads, size {args.size})", format_table(rows)]
    model_rows = (run_models(models, size=args.model_size or args.size, steps=args.steps.split(","),
                             dtypes=args.dtype.split(",")) if models else [])
    if model_rows:
        lines += ["", format_models(model_rows)]
    elif not args.models:
        lines.append("\nreal models: add --models all (the torch extra: pip install torch==2.13.0 transformers)")
    text = "\n".join(lines)
    print(text)
    if args.json:
        write_json(rows, args.json, dict(meta, models=[vars(r) for r in model_rows]))
        print(f"wrote {args.json}")
    if args.results != "none":
        for path in save_results(results_folder(args.results, args.machine), rows, model_rows, meta, text):
            print(f"wrote {path}")
    return 0 if all(r.agree for r in rows) else 1


def _model_names(text: str):
    """Model names from --models ('' none, 'all' every one); None after printing an error."""
    if not text:
        return []
    try:
        from tvm_stitch.tools.models import MODELS, _require_torch

        _require_torch()
    except RuntimeError as err:
        print(str(err), file=sys.stderr)
        return None
    names = list(MODELS) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(MODELS)}", file=sys.stderr)
        return None
    return names


def _load(args):
    """(module, description) named by `args.graph` (suite graph, model or script); None after printing why not."""
    from tvm_stitch.tools.sources import SourceError, load_module

    try:
        return load_module(args.graph, dtype=args.dtype, size=args.size)
    except SourceError as err:
        print(one_line(err), file=sys.stderr)
        return None


def _explain(args) -> int:
    from tvm_stitch.explain import explain_with_graph
    from tvm_stitch.target import as_target, host_target

    target = as_target({"kind": "cuda", "arch": args.arch} if args.target == "cuda" else host_target())
    if args.dot:
        check_writable_file(args.dot, "--dot")
    loaded = _load(args)
    if loaded is None:
        return 2
    mod, description = loaded
    report, grouped = explain_with_graph(mod, target, fusion=args.fusion)
    print(f"{description}, target {args.target}")
    print(report.table())
    if args.target == "cuda":
        from tvm_stitch.tools.module_time import comparison

        print(comparison(mod, target, report.spec, args.fusion, bounds=True))
    print()
    print(report.details())
    if args.dot:
        from tvm_stitch.tools.graph_picture import to_dot, write_picture

        print(write_picture(to_dot(grouped, report, title=f"{description}, {args.target}"), args.dot))
    return 0


def _sizes(texts: list) -> dict | None:
    """{name: values} from `NAME=V1,V2,...` texts; None after printing what is wrong."""
    sizes = {}
    for text in texts:
        name, _, values = text.partition("=")
        try:
            parsed = [int(v) for v in values.split(",")]
        except ValueError:
            parsed = []
        if not name.strip() or not parsed or min(parsed) < 1:
            print(f"--sizes {text!r}: expected NAME=V1,V2,... with positive integers (e.g. n=1,37,128)",
                  file=sys.stderr)
            return None
        sizes[name.strip()] = parsed
    return sizes


def _simt(args) -> int:
    from tvm_stitch import simt
    from tvm_stitch.simt.opencl_run import NoOpenclDevice, UnusableOpenclDevice
    from tvm_stitch.target import as_target

    as_target({"kind": "cuda", "arch": args.arch})
    loaded = _load(args)
    if loaded is None:
        return 2
    mod, description = loaded
    sizes = _sizes(args.sizes)
    if sizes is None:
        return 2
    try:
        report = simt.check(mod, {"kind": "cuda", "arch": args.arch}, oclgrind=args.oclgrind, seed=args.seed,
                            sizes=sizes)
    except (NoOpenclDevice, UnusableOpenclDevice) as err:
        print(str(err), file=sys.stderr)
        return 2
    print(f"{description}, CUDA {args.arch} kernels on {report.platform}")
    print(report)
    return 0 if report.ok else 1


def _fuzz(args) -> int:
    import json
    import os

    from tvm_stitch.tools.fuzz import fuzz

    if args.n < 1:
        print("--n must be at least 1", file=sys.stderr)
        return 2
    at_least(args.nvcc_every, 0, "--nvcc-every")
    if args.save:
        check_writable_folder(args.save, "--save")

    def progress(done, total, summary):
        if done % 10 == 0 or done == total:
            print(f"[{done}/{total}] {summary['stitched_kernels']} stitched kernels, "
                  f"{summary['fallbacks']} fallbacks, {len(summary['failures'])} failures",
                  file=sys.stderr, flush=True)

    def save(failure):
        print(f"FAILURE seed {failure['seed']}: {failure['message']}", file=sys.stderr, flush=True)
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            path = os.path.join(args.save, f"seed_{failure['seed']}.json")
            with open(path, "w", encoding="utf-8") as out:
                out.write(failure["spec"])

    summary = fuzz(args.n, args.seed, cuda=args.cuda, nvcc_every=args.nvcc_every,
                   progress=progress, on_failure=save, simt=args.simt or args.oclgrind, oclgrind=args.oclgrind)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    print(f"seeds {args.seed}..{args.seed + args.n - 1}: {len(summary['failures'])} failures "
          f"in {summary['seconds']:.0f} s")
    return 1 if summary["failures"] else 0


def _gpu_kit(args) -> int:
    from tvm_stitch.tools.gpu_kit import build_kit

    graphs = args.graphs.split(",") if args.graphs else None
    manifest = build_kit(args.out, size=args.size, graphs=graphs, dtypes=tuple(args.dtype.split(",")),
                         wheel=not args.no_wheel, hbm=False if args.no_hbm else None,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"kit in {args.out}: {len(manifest['entries'])} entries, {manifest['bytes'] / 2**20:.1f} MiB, "
          f"ffi wheel: {manifest['ffi_wheel']}")
    for warning in manifest.get("warnings", []):
        print(f"warning: {warning}")
    print(f"expected on the H200: quick {manifest['expected_seconds']['quick']} s, "
          f"full {manifest['expected_seconds']['full']} s")
    print(f"on the GPU machine: python3 {args.out}/run_kit.py --out $OUT [--full | --sanitize]")
    return 0


RESULTS = "benchmarks/results/cost-model"


def _tune(args) -> int:
    from pathlib import Path

    from tvm_stitch.tools.workloads import SUITE
    from tvm_stitch.target import host_target
    from tvm_stitch.tools.tune import GRAPHS, HELD_OUT_SHAPES, TRAIN_SHAPES, tune

    graphs = args.graphs.split(",") if args.graphs else GRAPHS
    unknown = [g for g in graphs if g not in SUITE]
    if unknown:
        print(f"unknown graph(s): {', '.join(unknown)}; the suite has: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    target = host_target()
    sets = {"train": (TRAIN_SHAPES, args.records), "held-out": (HELD_OUT_SHAPES, args.held_out)}
    wanted = ["train", "held-out"] if args.shapes == "all" else [args.shapes]
    for which in wanted:
        check_writable_file(sets[which][1], "--records" if which == "train" else "--held-out", makes_folders=True)
    failures = 0
    for which in wanted:
        shapes, path = sets[which]
        if args.fresh and Path(path).is_file():
            Path(path).unlink()
        print(f"tune ({which} shapes: {', '.join(shapes)}) -> {path}", file=sys.stderr, flush=True)
        summary = tune(Path(path), shapes, graphs, tuple(args.dtype.split(",")), target,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"{which}: {summary['measured']} groups measured, {summary['skipped']} already in {path}, "
              f"{summary['seconds']} s")
        for line in summary["disagreeing"] + summary["failed"]:
            print(f"  candidate problem: {line}")
        failures += len(summary["disagreeing"]) + len(summary["failed"])
    return 1 if failures else 0


def _train(args) -> int:
    from pathlib import Path

    from tvm_stitch.planning.cost_model import model_path, train
    from tvm_stitch.tools.tune import read_records

    records = [r for r in read_records(Path(args.records)) if "candidates" in r]
    if not records:
        print(f"no records in {args.records}: run `tvm-stitch tune` first", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else model_path("cpu")
    summary = train(records, out)
    print(f"trained on {summary['candidates']} candidates of {summary['groups']} groups, "
          f"{summary['rounds']} rounds -> {summary['path']}")
    return 0


def _evaluate(args) -> int:
    from pathlib import Path

    from tvm_stitch.tools.evaluate import evaluate

    check_writable_folder(args.out, "--out")
    result = evaluate(Path(args.held_out), Path(args.out), compile_graphs=not args.no_compile,
                      bench_graphs=not args.no_bench, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(result["markdown"])
    return 0 if result["done"] else 1


def _calibrate(args) -> int:
    from tvm_stitch.tools.calibrate import calibrate

    try:
        print(calibrate(args.records, arch=args.arch, write=args.write, out=args.out))
    except (OSError, ValueError) as err:
        print(str(err), file=sys.stderr)
        return 2
    return 0


def _torch_compile(args) -> int:
    from tvm_stitch.tools.bench import machine_name
    from tvm_stitch.tools.torch_compile_bench import MODELS, STEPS, format_rows, run

    models, steps = args.models.split(","), args.steps.split(",")
    bad = [m for m in models if m not in MODELS] + [s for s in steps if s not in STEPS]
    if bad:
        print(f"unknown: {', '.join(bad)}; models: {', '.join(MODELS)}; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    from tvm_stitch.tools.models import SIZES

    if args.size not in SIZES:
        print(f"--size must be one of {', '.join(SIZES)}, not {args.size!r}", file=sys.stderr)
        return 2
    at_least(args.rounds, 1, "--rounds")
    print(f"torch.compile on {machine_name()}, size {args.size}, {args.rounds} alternating rounds", flush=True)
    rows = run(models, steps, size=args.size, rounds=args.rounds, round_ms=args.round_ms,
               progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(format_rows(rows))
    from tvm_stitch.torch import counters

    print(f"backend='tvm_stitch': {counters()}")
    return 0


def _cache(args) -> int:
    from tvm_stitch.torch.cache_command import cache_command

    return cache_command(args.action, args.dir, invalid=args.invalid)


def _add_bench(sub) -> None:
    """The `bench` command's arguments."""
    bench = sub.add_parser("bench", help="run the graph suite with TVM's default pipeline and with tvm-stitch")
    bench.add_argument("--target", choices=["llvm", "cuda"], default="llvm",
                       help="llvm (default): CPU timings; cuda: also time on a GPU where one is present")
    bench.add_argument("--graphs", default="", help="comma-separated suite graphs (default: all)")
    bench.add_argument("--dtype", default="float32",
                       help="float32, float16, bfloat16, comma-separated (suite graphs: those they have; "
                            "--models: each model cast to each)")
    bench.add_argument("--size", choices=["bench", "test"], default="bench")
    bench.add_argument("--json", default="", help="also write the rows as JSON to this path")
    bench.add_argument("--models", default="",
                       help="real models too: 'all' or comma-separated (bert, gpt2, llama, convnext; "
                            "needs the torch extra); --size test makes them tiny")
    bench.add_argument("--model-size", choices=["bench", "cpu", "test"], default="",
                       help="size of the models (default: --size); cpu: hidden 384, batch 4 x 128 (models.py)")
    bench.add_argument("--steps", default="forward,backward,adam",
                       help="model steps: forward, backward (joint forward + backward), adam (optimizer step)")
    bench.add_argument("--torch", action="store_true",
                       help="also time PyTorch eager and torch.compile on the CPU (pip install torch==2.13.0)")
    bench.add_argument("--results", default="benchmarks/results",
                       help="write RESULTS/MACHINE/DATE.json, .md and PNG plots there ('none': do not write)")
    bench.add_argument("--machine", default="", help="folder name of this machine (default: cpu-<cores>core)")
    bench.set_defaults(func=_bench)


def _add_explain(sub) -> None:
    """The `explain` command's arguments."""
    exp = sub.add_parser("explain", help="print the stitch plan of a suite graph, a model or a script")
    exp.add_argument("graph", help="a suite graph (layernorm, ...), a model (bert, gpt2, llama, convnext; "
                                   "MODEL:backward or MODEL:adam for training steps), or a .py file defining "
                                   "module() or mod (a Relax IRModule)")
    exp.add_argument("--dot", default="", help="also write a Graphviz DOT picture of the grouped graph here "
                                                "(rendered to FILE.svg when Graphviz's dot is installed)")
    exp.add_argument("--target", choices=["llvm", "cuda"], default="cuda",
                     help="cuda (default) or llvm (this machine's CPU model, as bench builds it)")
    exp.add_argument("--arch", default="sm_90")
    exp.add_argument("--dtype", default="float32")
    exp.add_argument("--size", choices=["bench", "test"], default="bench")
    exp.add_argument("--fusion", choices=["search", "greedy"], default="search",
                     help="the grouping: search (default: the fusion search, docs/fusion-search.md) or greedy")
    exp.set_defaults(func=_explain)


def _add_simt(sub) -> None:
    """The `simt` command's arguments."""
    sm = sub.add_parser("simt", help="run every stitched CUDA kernel with SIMT semantics on the CPU "
                                     "(OpenCL on pocl, or Oclgrind: races, bounds, uninitialised reads)")
    sm.add_argument("graph", help="a suite graph, a model (MODEL[:backward|:adam]) or a .py file, as for explain")
    sm.add_argument("--oclgrind", action="store_true",
                    help="run on the Oclgrind simulator: also report data races, out-of-bounds accesses and "
                         "uninitialised reads (slow: use --size test)")
    sm.add_argument("--arch", default="sm_90", help="the CUDA architecture the kernels are planned for")
    sm.add_argument("--dtype", default="float32")
    sm.add_argument("--size", choices=["bench", "test"], default="test")
    sm.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    sm.add_argument("--sizes", action="append", default=[], metavar="NAME=V1,V2,...",
                    help="values a symbolic variable's kernels run at (repeatable; default: its lower bound, "
                         "an odd value and its upper bound, 1, 37 and 128 where unbounded)")
    sm.set_defaults(func=_simt)


def _add_fuzz(sub) -> None:
    """The `fuzz` command's arguments."""
    fz = sub.add_parser("fuzz", help="check random memory-intensive graphs: stitched vs TVM's default")
    fz.add_argument("--n", type=int, default=100, help="number of graphs")
    fz.add_argument("--seed", type=int, default=0, help="first seed (graph i uses seed + i)")
    fz.add_argument("--cuda", action="store_true", help="also build every graph for CUDA (sm_90)")
    fz.add_argument("--nvcc-every", type=int, default=0, help="compile every k-th CUDA build with nvcc")
    fz.add_argument("--simt", action="store_true",
                    help="also run each graph's stitched CUDA kernels with SIMT semantics on pocl (tvm-stitch simt)")
    fz.add_argument("--oclgrind", action="store_true",
                    help="with --simt: run small graphs under Oclgrind (races, bounds, uninitialised reads)")
    fz.add_argument("--save", default="", help="folder for the shrunk specs of failing graphs")
    fz.set_defaults(func=_fuzz)


def _add_gpu_kit(sub) -> None:
    """The `gpu-kit` command's arguments."""
    kit = sub.add_parser("gpu-kit", help="build and pack the GPU check kit (no GPU needed to build it)")
    kit.add_argument("--out", default="benchmarks/gpu/pack")
    kit.add_argument("--size", choices=["bench", "test"], default="bench")
    kit.add_argument("--graphs", default="", help="comma-separated suite graphs (default: all)")
    kit.add_argument("--dtype", default="float32,float16")
    kit.add_argument("--no-wheel", action="store_true", help="do not download the apache-tvm-ffi wheel")
    kit.add_argument("--no-hbm", action="store_true", help="leave out the HBM-sized entries (bench size only)")
    kit.set_defaults(func=_gpu_kit)


def _add_tune(sub) -> None:
    """The `tune` command's arguments."""
    tn = sub.add_parser("tune", help="time every candidate configuration of the suite's groups (CPU), "
                                     "writing JSON-lines records; resumes an interrupted run")
    tn.add_argument("--shapes", choices=["train", "held-out", "all"], default="all")
    tn.add_argument("--records", default=f"{RESULTS}/records-cpu.jsonl", help="records of the training shapes")
    tn.add_argument("--held-out", default=f"{RESULTS}/held-out-cpu.jsonl", help="records of the held-out shapes")
    tn.add_argument("--graphs", default="", help="comma-separated suite graphs (default: all but the shape variants)")
    tn.add_argument("--dtype", default="float32", help="float32, float16 or both comma-separated")
    tn.add_argument("--fresh", action="store_true", help="delete the records first instead of resuming")
    tn.set_defaults(func=_tune)


def _add_train(sub) -> None:
    """The `train` command's arguments."""
    tr = sub.add_parser("train", help="train the CPU cost model from tune records")
    tr.add_argument("--records", default=f"{RESULTS}/records-cpu.jsonl")
    tr.add_argument("--out", default="", help="model file (default: the shipped planning/cost_models/cpu.json)")
    tr.set_defaults(func=_train)


def _add_evaluate(sub) -> None:
    """The `evaluate` command's arguments."""
    ev = sub.add_parser("evaluate", help="the model's choices on held-out shapes vs the best and the rules; "
                                         "compile time with and without the model")
    ev.add_argument("--held-out", default=f"{RESULTS}/held-out-cpu.jsonl")
    ev.add_argument("--out", default=RESULTS, help="folder for evaluation.json and evaluation.md")
    ev.add_argument("--no-compile", action="store_true", help="skip the compile-time comparison")
    ev.add_argument("--no-bench", action="store_true",
                    help="skip timing the suite at bench shapes with the model and with rules")
    ev.set_defaults(func=_evaluate)


def _add_torch_compile(sub) -> None:
    """The `torch-compile` command's arguments."""
    tc = sub.add_parser("torch-compile", help="time eager, torch.compile's default backend (Inductor) and "
                                              "backend='tvm_stitch' on real models, forward and a training step")
    tc.add_argument("--models", default="bert,gpt2-hf,llama-hf,convnext")
    tc.add_argument("--steps", default="forward,train")
    tc.add_argument("--size", default="test", help="a size of tools/models.SIZES (test, cpu, bench)")
    tc.add_argument("--rounds", type=int, default=5)
    tc.add_argument("--round-ms", type=float, default=200.0, help="each round runs a contender this long at least")
    tc.set_defaults(func=_torch_compile)


def _add_calibrate(sub) -> None:
    """The `calibrate` command's arguments."""
    cal = sub.add_parser("calibrate", help="fit the CUDA time model's constants to kernels timed on a GPU "
                                           "(the GPU kit's calibration.jsonl) and print the model's error")
    cal.add_argument("records", help="JSON-lines records: per PrimFunc its kernels' geometry and measured time")
    cal.add_argument("--arch", default="", help="the arch to fit (default: the records' only one)")
    cal.add_argument("--write", action="store_true",
                     help="store the fit as tvm_stitch/planning/time_fits/ARCH.json, which the TargetSpec loads")
    cal.add_argument("--out", default="", help="with --write: this file instead")
    cal.set_defaults(func=_calibrate)


def _add_cache(sub) -> None:
    """The `cache` command's arguments."""
    ca = sub.add_parser("cache", help="the disk compile cache of backend='tvm_stitch': show its entries, verify "
                                      "them as loading does, or clear them")
    ca.add_argument("action", nargs="?", default="show", help="show (the default), verify or clear")
    ca.add_argument("--dir", default="", help="the cache directory (default: $TVM_STITCH_CACHE_DIR)")
    ca.add_argument("--invalid", action="store_true", help="with clear: only the entries that fail verify")
    ca.set_defaults(func=_cache)


def main(argv=None) -> int:
    parser = OneLineParser(prog="tvm-stitch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    _add_explain(sub)
    _add_simt(sub)
    _add_fuzz(sub)
    _add_gpu_kit(sub)
    _add_tune(sub)
    _add_train(sub)
    _add_evaluate(sub)
    _add_torch_compile(sub)
    _add_calibrate(sub)
    _add_cache(sub)
    args = parser.parse_args(argv)
    args.argv = argv
    known = ("float32", "float16", "bfloat16") if getattr(args, "func", None) is _bench else ("float32", "float16")
    for dtype in getattr(args, "dtype", "float32").split(","):
        if dtype not in known:
            parser.error(f"--dtype must be {' or '.join(known)}, not {dtype!r}")
    return run_command(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
