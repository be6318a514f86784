"""The `tvm-stitch` command: `bench` (the suite, default vs stitched) and `explain` (plans)."""

from __future__ import annotations

import argparse
import sys


def _bench(args) -> int:
    from .bench import bench_metadata, format_table, run_bench, write_json
    from .suite import SUITE

    graphs = args.graphs.split(",") if args.graphs else list(SUITE)
    unknown = [g for g in graphs if g not in SUITE]
    if unknown:
        print(f"unknown graph(s): {', '.join(unknown)}; the suite has: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    rows = []
    for dtype in args.dtype.split(","):
        rows += run_bench(graphs, dtype=dtype, size=args.size, target=args.target)
    meta = bench_metadata(args.size, args.dtype)
    print(f"tvm-stitch bench on {meta['machine']} (TVM {meta['tvm']}, {meta['threads']} threads, size {args.size})")
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json, meta)
        print(f"wrote {args.json}")
    return 0 if all(r.agree for r in rows) else 1


def _explain(args) -> int:
    from . import explain
    from .suite import SUITE, dims

    if args.graph not in SUITE:
        print(f"unknown graph {args.graph!r}; the suite has: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    target = {"kind": "cuda", "arch": args.arch} if args.target == "cuda" else {"kind": "llvm"}
    report = explain(SUITE[args.graph].build(args.dtype, dims(args.size)), target)
    print(report.table())
    print()
    print(report.details())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tvm-stitch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run the graph suite with TVM's default pipeline and with tvm-stitch")
    bench.add_argument("--target", choices=["llvm", "cuda"], default="llvm",
                       help="llvm (default): CPU timings; cuda: also time on a GPU where one is present")
    bench.add_argument("--graphs", default="", help="comma-separated suite graphs (default: all)")
    bench.add_argument("--dtype", default="float32", help="float32, float16 or both comma-separated")
    bench.add_argument("--size", choices=["bench", "test"], default="bench")
    bench.add_argument("--json", default="", help="also write the rows as JSON to this path")
    bench.set_defaults(func=_bench)

    exp = sub.add_parser("explain", help="print the stitch plan of a suite graph")
    exp.add_argument("graph")
    exp.add_argument("--target", choices=["llvm", "cuda"], default="cuda")
    exp.add_argument("--arch", default="sm_90")
    exp.add_argument("--dtype", default="float32")
    exp.add_argument("--size", choices=["bench", "test"], default="bench")
    exp.set_defaults(func=_explain)

    args = parser.parse_args(argv)
    for dtype in getattr(args, "dtype", "float32").split(","):
        if dtype not in ("float32", "float16"):
            parser.error(f"--dtype must be float32 or float16, not {dtype!r}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
