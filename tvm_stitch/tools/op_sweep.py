"""Every Relax operator that legalizes to memory-intensive TIR, built stitched and by TVM's default.

The operators come from TVM's registry: each `relax.*` op with an
`FLegalize` attribute is built once (float32, else the first dtype it takes)
on a small tensor, legalized, and classified by the `op_pattern`
AnnotateTIROpPattern gives its PrimFuncs (the largest, where there are
several): element-wise, broadcast, injective and reduction ops are swept,
and so are the chains of stages (softmax, layer norm: out-element-wise-fusable)
that analysis/classify finds memory-bound, as reductions; the rest
(matmuls and convolutions, opaque and tuple ops, ops that lower to no
PrimFunc) are listed with their class. An op's arguments are read
from its registered argument list and its Python constructor's signature
(`ARGUMENTS` and `_call` say how, with `SPECIAL` for the few ops whose
arguments neither can tell).

A case is (op, dtype, form, target): the op alone or feeding a reduction
(`f - sum(f, -1)` of its result, cast to float32 where it is not a float),
in each of `DTYPES` its type inference accepts, for each of `TARGETS`. On
llvm the stitched build runs and must match TVM's default build
(`tolerance.close`); on CUDA it must build wherever the default builds.
A case the default cannot build is counted as skipped, not checked.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from tvm_stitch.analysis.classify import classify_primfunc
from tvm_stitch.planning.reasons import error_line
from tvm_stitch.tools.tolerance import close

DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "bool")
FLOATS = ("float32", "float16", "bfloat16")
SHAPE = (4, 8)
SHAPES = (SHAPE, (2, 4, 8), (2, 4, 4, 8), (2, 2, 4, 4, 8))
FORMS = ("alone", "chain")
PATTERNS = {0: "element-wise", 1: "broadcast", 2: "injective", 3: "reduction",
            4: "out-element-wise-fusable", 7: "tuple", 8: "opaque"}
SWEPT = ("element-wise", "broadcast", "injective", "reduction")


def targets() -> dict:
    """The targets of a case, by label: llvm for this CPU and generic, CUDA sm_80 and sm_90."""
    from tvm_stitch.target import host_target

    return {"llvm-host": host_target(), "llvm-generic": tvm.target.Target({"kind": "llvm"}),
            "cuda-sm_80": tvm.target.Target({"kind": "cuda", "arch": "sm_80"}),
            "cuda-sm_90": tvm.target.Target({"kind": "cuda", "arch": "sm_90"})}


# --- building one op's call -------------------------------------------------------------------

@dataclass(frozen=True)
class Input:
    """A parameter of a case's module: shape, dtype and the values it is drawn from."""

    shape: tuple
    dtype: str
    role: str = "value"  # value | positive | index | bool | sorted

    def var(self, name: str) -> relax.Var:
        return relax.Var(name, relax.TensorType(self.shape, self.dtype))

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        if self.role == "index":
            data = rng.integers(0, 4, self.shape)
        elif self.role == "bool" or self.dtype == "bool":
            return rng.random(self.shape) < 0.5
        elif self.role == "sorted":
            data = np.sort(rng.uniform(-2.0, 2.0, self.shape))
        elif self.dtype.startswith("int"):
            data = rng.integers(1 if self.role == "positive" else -8, 8, self.shape)
        else:
            data = rng.uniform(0.5, 2.0, self.shape) if self.role == "positive" else rng.uniform(-2, 2, self.shape)
        return data.astype(_numpy_dtype(self.dtype))


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _other_dtype(dtype: str) -> str:
    return "float16" if dtype == "float32" else "float32"


# op name -> (inputs for the dtype, call of the op on their variables): arguments the registry
# and the constructor's signature cannot tell (shapes, axes, index tensors, maps).
SPECIAL = {
    "relax.astype": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.astype(x, _other_dtype(d))),
    "relax.broadcast_to": lambda d: ([Input((1, 8), d)], lambda x: relax.op.broadcast_to(x, (4, 8))),
    "relax.reshape": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.reshape(x, (8, 4))),
    "relax.collapse_sum_to": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.collapse_sum_to(x, (1, 8))),
    "relax.collapse_sum_like": lambda d: ([Input(SHAPE, d), Input((1, 8), d)], relax.op.collapse_sum_like),
    "relax.expand_dims": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.expand_dims(x, 1)),
    "relax.squeeze": lambda d: ([Input((4, 1, 8), d)], lambda x: relax.op.squeeze(x, [1])),
    "relax.flip": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.flip(x, 1)),
    "relax.tile": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.tile(x, (2, 1))),
    "relax.repeat": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.repeat(x, 2, axis=1)),
    "relax.split": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.split(x, 2, axis=1)),
    "relax.strided_slice": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.strided_slice(x, [1], [1], [7], [2])),
    "relax.take": lambda d: ([Input(SHAPE, d), Input((3,), "int64", "index")],
                             lambda x, i: relax.op.take(x, i, axis=1)),
    "relax.gather_elements": lambda d: ([Input(SHAPE, d), Input(SHAPE, "int64", "index")],
                                        lambda x, i: relax.op.gather_elements(x, i, axis=1)),
    "relax.gather_nd": lambda d: ([Input(SHAPE, d), Input((3, 1), "int64", "index")], relax.op.gather_nd),
    "relax.where": lambda d: ([Input(SHAPE, "bool", "bool"), Input(SHAPE, d), Input(SHAPE, d)], relax.op.where),
    "relax.clip": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.clip(x, relax.prim_value(-1), relax.prim_value(1))),
    "relax.one_hot": lambda d: ([Input((4,), "int64", "index")], lambda i: relax.op.one_hot(
        i, relax.prim_value(tvm.tirx.const(1, d)), relax.prim_value(tvm.tirx.const(0, d)), 8)),
    "relax.nn.pad": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.nn.pad(x, [0, 0, 1, 2])),
    "relax.permute_dims": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.permute_dims(x, [1, 0])),
    "relax.tril": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.tril(x, 0)),
    "relax.triu": lambda d: ([Input(SHAPE, d)], lambda x: relax.op.triu(x, 1)),
    "relax.full": lambda d: ([Input((), d)], lambda v: relax.op.full(SHAPE, v, d)),
    "relax.ones": lambda d: ([], lambda: relax.op.ones(SHAPE, d)),
    "relax.zeros": lambda d: ([], lambda: relax.op.zeros(SHAPE, d)),
    "relax.arange": lambda d: ([], lambda: relax.op.arange(0, 8, 1, d)),
    "relax.eye": lambda d: ([], lambda: relax.op.eye(4, 8, 0, d)),
    "relax.full_like": lambda d: ([Input(SHAPE, d), Input((), d)], relax.op.full_like),
    "relax.bucketize": lambda d: ([Input(SHAPE, d), Input((5,), d, "sorted")], relax.op.bucketize),
    "relax.reverse_sequence": lambda d: ([Input(SHAPE, d), Input((4,), "int64", "index")],
                                         lambda x, s: relax.op.reverse_sequence(x, s, seq_axis=1, batch_axis=0)),
    "relax.nn.layer_norm": lambda d: ([Input(SHAPE, d), Input((8,), d), Input((8,), d)],
                                      lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1])),
    "relax.nn.rms_norm": lambda d: ([Input(SHAPE, d), Input((8,), d)], relax.op.nn.rms_norm),
    "relax.nn.group_norm": lambda d: ([Input((2, 4, 8), d), Input((4,), d), Input((4,), d)],
                                      lambda x, g, b: relax.op.nn.group_norm(x, g, b, 2, 1, [2])),
    "relax.nn.instance_norm": lambda d: ([Input((2, 4, 8), d), Input((4,), d), Input((4,), d)],
                                         lambda x, g, b: relax.op.nn.instance_norm(x, g, b, 1, [2])),
    "relax.nn.batch_norm": lambda d: ([Input((2, 4, 8), d), Input((4,), d), Input((4,), d), Input((4,), d),
                                       Input((4,), d, "positive")],
                                      lambda x, g, b, m, v: relax.op.nn.batch_norm(x, g, b, m, v, 1, training=False)),
    "relax.nn.prelu": lambda d: ([Input(SHAPE, d), Input((8,), d)], lambda x, a: relax.op.nn.prelu(x, a, axis=1)),
    "relax.nn.pixel_shuffle": lambda d: ([Input((1, 4, 2, 2), d)], lambda x: relax.op.nn.pixel_shuffle(x, 2)),
    "relax.nn.nll_loss": lambda d: ([Input(SHAPE, d), Input((4,), "int64", "index")], relax.op.nn.nll_loss),
    "relax.nn.cross_entropy_with_logits": lambda d: ([Input(SHAPE, d), Input(SHAPE, d, "positive")],
                                                     relax.op.nn.cross_entropy_with_logits),
    "relax.slice_scatter": lambda d: ([Input(SHAPE, d), Input((4, 2), d)],
                                      lambda x, s: relax.op.slice_scatter(x, s, 2, 4, 1, axis=1)),
    "relax.scatter_elements": lambda d: ([Input(SHAPE, d), Input(SHAPE, "int64", "index"), Input(SHAPE, d)],
                                         lambda x, i, u: relax.op.scatter_elements(x, i, u, axis=1)),
    "relax.index_tensor": lambda d: ([Input(SHAPE, d), Input((3,), "int64", "index")],
                                     lambda x, i: relax.op.index_tensor(x, [i])),
    "relax.eye_like": lambda d: ([Input(SHAPE, d)], relax.op.eye_like),
    "relax.layout_transform": lambda d: ([Input(SHAPE, d)],
                                         lambda x: relax.op.layout_transform(x, lambda i, j: (j, i))),
    "relax.dequantize": lambda d: ([Input(SHAPE, "int32"), Input((), "float32", "positive"), Input((), "int32")],
                                   lambda x, s, z: relax.op.dequantize(x, s, z, out_dtype=d)),
    "relax.quantize": lambda d: ([Input(SHAPE, "float32"), Input((), "float32", "positive"), Input((), d)],
                                 lambda x, s, z: relax.op.quantize(x, s, z, out_dtype=d)),
}
# Python parameter names (beyond the tensors) given a value of their own where their default
# would reduce to a scalar: a reduction over rows, as the models do.
ROW_AXIS = ("axis",)


def python_api(name: str):
    """The Python constructor of a registered Relax op (`relax.nn.silu` -> relax.op.nn.silu), or None."""
    obj = relax.op
    for part in name.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


def _call(name: str, dtype: str):
    """(inputs, build(*vars) -> call) for `name` in `dtype`, or raise ValueError saying why not."""
    if name in SPECIAL:
        return SPECIAL[name](dtype)
    func = python_api(name)
    if func is None:
        raise ValueError("no Python constructor")
    kinds = [a.type_info for a in tvm.ir.Op.get(name).arguments]
    if any(k not in ("Tensor", "Tuple of Tensors") for k in kinds):
        raise ValueError(f"arguments {kinds} need a constructor in SPECIAL")
    params = list(inspect.signature(func).parameters.values())
    required = [p.name for p in params[len(kinds):] if p.default is inspect.Parameter.empty]
    if required:
        raise ValueError(f"required parameters {required} need a constructor in SPECIAL")
    kwargs = {p.name: -1 for p in params[len(kinds):] if p.name in ROW_AXIS and p.default is None}
    tuple_sizes = [2 if kind == "Tuple of Tensors" else 0 for kind in kinds]

    def build(*vars_):
        args, i = [], 0
        for size in tuple_sizes:
            args.append(list(vars_[i:i + size]) if size else vars_[i])
            i += max(1, size)
        return func(*args, **kwargs)

    error = None
    for shape in SHAPES:  # the first rank the op's type inference takes (pools, convolutions: 3-D..5-D)
        # the tensors after the first take positive values (divisors, exponents, shift amounts)
        inputs = [Input(shape, dtype, "value" if k == 0 and not j else "positive")
                  for k, size in enumerate(tuple_sizes) for j in range(max(1, size))]
        try:
            relax.BlockBuilder().normalize(build(*[inp.var(f"x{k}") for k, inp in enumerate(inputs)]))
        except Exception as err:  # noqa: BLE001 - try the next rank
            error = error or err
            continue
        return inputs, build
    raise error


@dataclass
class Case:
    op: str
    dtype: str
    form: str  # alone | chain

    def module(self) -> tvm.IRModule:
        """The case as a Relax module of one function `main`."""
        inputs, build = _call(self.op, self.dtype)
        params = [inp.var(f"x{k}") for k, inp in enumerate(inputs)]
        call = relax.BlockBuilder().normalize(build(*params))  # type inference, outside a function
        bb = relax.BlockBuilder()
        with bb.function("main", params):
            with bb.dataflow():
                out = bb.emit(call)
                if self.form == "chain":
                    out = _reduction_chain(bb, out)
                out = bb.emit_output(out)
            bb.emit_func_output(out)
        return bb.get()


def _reduction_chain(bb: relax.BlockBuilder, value):
    """`f - sum(f, -1)` of `value` (its first field, where it is a tuple), as float32 unless a float."""
    if isinstance(value.ty, relax.TupleType):
        value = bb.emit(relax.TupleGetItem(value, 0))
    if str(value.ty.dtype) not in FLOATS:
        value = bb.emit(relax.op.astype(value, "float32"))
    if value.ty.ndim == 0:
        return relax.op.multiply(value, value)
    total = bb.emit(relax.op.sum(value, axis=-1, keepdims=True))
    return relax.op.subtract(value, total)


# --- the registry, classified -------------------------------------------------------------------

def registered_ops() -> list:
    """Names of the Relax ops with a legalization (`FLegalize`), sorted."""
    return sorted(n for n in tvm.ir.Op.list_op_names()
                  if n.startswith("relax.") and tvm.ir.Op.get(n).get_attr("FLegalize") is not None)


@dataclass
class OpClass:
    name: str
    kind: str  # a PATTERNS value, or "not built" / "no PrimFunc"
    dtypes: tuple = ()  # the DTYPES the op's type inference and legalization accept
    reason: str = ""


def _kind(mod: tvm.IRModule) -> str | None:
    """The PATTERNS name of the largest op_pattern of `mod`'s PrimFuncs once legalized (None: no
    PrimFunc); "reduction" for a chain of stages (softmax: out-element-wise-fusable) that
    analysis/classify finds memory-bound."""
    annotated = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
    funcs = [f for _, f in annotated.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "op_pattern" in f.attrs]
    if not funcs:
        return None
    pattern = max(int(f.attrs["op_pattern"]) for f in funcs)
    if pattern == 4 and all(classify_primfunc(f).kind.memory_bound for f in funcs):
        return "reduction"
    return PATTERNS.get(pattern, f"pattern {pattern}")


@functools.lru_cache(maxsize=None)
def classify(name: str) -> OpClass:
    """What `name` legalizes to, and in which dtypes it builds (a module per dtype, legalized)."""
    accepted, kinds, reason = [], set(), ""
    for dtype in DTYPES:
        try:
            kind = _kind(Case(name, dtype, "alone").module())
        except Exception as err:  # noqa: BLE001 - the op does not take this dtype (or these arguments)
            reason = reason or _last_line(err)
            continue
        if kind is None:
            return OpClass(name, "no PrimFunc", reason="legalizes to no PrimFunc")
        kinds.add(kind)
        accepted.append(dtype)
    if not accepted:
        return OpClass(name, "not built", reason=reason)
    kind = max(kinds, key=lambda k: (k not in SWEPT, SWEPT.index(k) if k in SWEPT else 0))
    return OpClass(name, kind, tuple(accepted))


def swept_ops() -> list:
    """The OpClass of every registered op that legalizes to element-wise .. reduction TIR."""
    return [c for c in map(classify, registered_ops()) if c.kind in SWEPT]


@functools.lru_cache(maxsize=None)
def elementwise_ops(arity: int) -> tuple:
    """Names of the element-wise ops of `arity` tensors that take float32 (the fuzzer's draw)."""
    out = []
    for name in registered_ops():
        kinds = [a.type_info for a in tvm.ir.Op.get(name).arguments]
        if name in SPECIAL or kinds != ["Tensor"] * arity:
            continue
        try:
            kind = _kind(Case(name, "float32", "alone").module())
        except Exception:  # noqa: BLE001 - not an op of float32 tensors
            continue
        if kind == "element-wise":
            out.append(name)
    return tuple(out)


def cases(ops=None, dtypes=DTYPES, forms=FORMS) -> list:
    """Every (op, dtype, form) of the swept ops (or of `ops`, names) in `dtypes` they accept."""
    chosen = swept_ops() if ops is None else [classify(n) for n in ops]
    return [Case(c.name, d, f) for c in chosen for d in c.dtypes if d in dtypes for f in forms]


# --- checking a case ------------------------------------------------------------------------------

@dataclass
class Result:
    case: Case
    target: str
    status: str  # match | built | skipped (default fails) | mismatch | stitched fails
    detail: str = ""
    fallbacks: list = field(default_factory=list)  # fallback reasons of the stitched build
    stitched: int = 0  # stitched kernels

    @property
    def ok(self) -> bool:
        return self.status in ("match", "built", "skipped")


def _last_line(err) -> str:
    return f"{type(err).__name__}: {error_line(err)}"


def check(case: Case, label: str, target, seed: int = 0) -> Result:
    """The case on one target: the stitched build against TVM's default one."""
    from tvm_stitch.target import GenericCpuWarning
    from tvm_stitch.tools.build import build, run_cpu

    mod = case.module()
    warnings.simplefilter("ignore", GenericCpuWarning)  # the generic llvm target is meant
    try:
        default = build(mod, target, stitched=False)
    except Exception as err:  # noqa: BLE001 - TVM's own build fails: nothing to compare with
        return Result(case, label, "skipped", _last_line(err))
    try:
        stitched = build(mod, target, stitched=True)
    except Exception as err:  # noqa: BLE001 - the failure this sweep looks for
        return Result(case, label, "stitched fails", _last_line(err))
    report = stitched.report
    result = Result(case, label, "built", fallbacks=[g.fallback for g in report.fallbacks],
                    stitched=len(report.plans))
    if target.kind.name != "llvm":
        return result
    inputs, _ = _call(case.op, case.dtype)
    arrays = [inp.draw(np.random.default_rng(seed + k)) for k, inp in enumerate(inputs)]
    want, got = run_cpu(default.executable, arrays), run_cpu(stitched.executable, arrays)
    for k, (g, w) in enumerate(zip(got, want)):
        # a float16/bfloat16 case carries that type's error, whatever the output's dtype
        dtype = case.dtype if case.dtype in ("float16", "bfloat16") else str(w.dtype)
        if not close(g, w, dtype):
            result.status, result.detail = "mismatch", f"output {k}: {_difference(g, w)}"
            return result
    result.status = "match"
    return result


def _difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} vs {want.shape}"
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return f"max abs difference {np.nanmax(diff) if diff.size else 0}"


def sweep(selected=None, labels=None, progress=None, done=()) -> list:
    """Results of every case (or `selected` cases) on every target (or those of `labels`), but for
    the (op, dtype, form, target) keys in `done` (a resumed run)."""
    chosen = targets() if labels is None else {k: v for k, v in targets().items() if k in labels}
    out = []
    for case in cases() if selected is None else selected:
        for label, target in chosen.items():
            if (case.op, case.dtype, case.form, label) in done:
                continue
            out.append(check(case, label, target))
            if progress is not None:
                progress(out[-1])
    return out


def to_record(result: Result) -> dict:
    """A result as plain data (a line of a sweep's log)."""
    return {"op": result.case.op, "dtype": result.case.dtype, "form": result.case.form,
            "target": result.target, "status": result.status, "detail": result.detail,
            "fallbacks": list(result.fallbacks), "stitched": result.stitched}


def from_record(record: dict) -> Result:
    return Result(Case(record["op"], record["dtype"], record["form"]), record["target"], record["status"],
                  record["detail"], record["fallbacks"], record["stitched"])


def read_log(path: str) -> list:
    """The results a sweep's log (JSON lines, `--log`) holds; none where it does not exist yet."""
    import json
    import os

    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as lines:
        return [from_record(json.loads(line)) for line in lines if line.strip()]


def summary(results: list) -> dict:
    """Counts by status and target, the failures, and the fallback reasons by op."""
    counts, failures, fallbacks = {}, [], {}
    for r in results:
        counts.setdefault(r.target, {}).setdefault(r.status, 0)
        counts[r.target][r.status] += 1
        if not r.ok:
            failures.append(f"{r.case.op} {r.case.dtype} {r.case.form} {r.target}: {r.status} {r.detail}")
        for reason in r.fallbacks:
            fallbacks.setdefault(r.case.op, set()).add(reason)
    return {"cases": len(results), "by_target": counts, "failures": failures,
            "fallbacks": {op: sorted(v) for op, v in sorted(fallbacks.items())}}


def main(argv=None) -> int:
    """`python -m tvm_stitch.tools.op_sweep [--ops a,b] [--targets llvm-host,...] [--dtypes ...] [--list]`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", help="comma-separated op names (default: every swept op)")
    parser.add_argument("--targets", help=f"comma-separated labels among {', '.join(targets())}")
    parser.add_argument("--dtypes", help=f"comma-separated among {', '.join(DTYPES)}")
    parser.add_argument("--list", action="store_true", help="print the registry's classification and stop")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--log", help="append each result to this file (JSON lines) and skip the cases it "
                        "already holds: a stopped sweep resumes where it was")
    args = parser.parse_args(argv)
    if args.list:
        for c in map(classify, registered_ops()):
            print(f"{c.name:40s} {c.kind:26s} {','.join(c.dtypes):45s} {c.reason}")
        return 0
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else DTYPES
    selected = cases(args.ops.split(",") if args.ops else None, dtypes)
    labels = args.targets.split(",") if args.targets else None
    logged = read_log(args.log) if args.log else []

    def progress(r):
        print(r.case.op, r.case.dtype, r.case.form, r.target, r.status, r.stitched, r.detail, r.fallbacks, flush=True)
        if args.log:
            with open(args.log, "a", encoding="utf-8") as log:
                log.write(json.dumps(to_record(r)) + "\n")

    done = {(r.case.op, r.case.dtype, r.case.form, r.target) for r in logged}
    results = [r for r in logged if r.case in selected and (labels is None or r.target in labels)]
    results += sweep(selected, labels, progress, done)
    text = json.dumps(summary(results), indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
