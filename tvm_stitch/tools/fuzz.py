"""Random memory-intensive graphs: the stitched build must agree with TVM's default build.

A graph is a `Spec` — plain data (inputs, steps, outputs) that builds a Relax
module — so a failing graph can be shrunk by dropping steps and saved as
JSON for a regression test. Every graph is checked on llvm (stitched vs
TVM's default, within a dtype-aware tolerance, NaN/inf patterns equal), and
optionally compiled for CUDA with the stitch pipeline (codegen, plus nvcc
where asked), and (`--simt`) its stitched CUDA kernels run with SIMT
semantics on pocl or Oclgrind (tvm_stitch.simt).

Ops: unary element-wise (exp, log, erf, tanh, sigmoid, rsqrt, sqrt, abs,
negative, power, each on an argument it is defined and finite for), binary
(add, subtract, multiply, divide, maximum, minimum, where over a comparison)
with broadcasts from lower ranks, and every other element-wise op of one or
two float tensors in TVM's registry (op_sweep.elementwise_ops, named
`relax.*`), in float32, on arguments squashed into (0.05, 0.95) (the second
of two; `DOMAIN` moves an op's), with a boolean result as a `where` between
its arguments; reductions
(sum, mean, max, min; keepdims both ways; inner, outer, middle and several
axes), reshape, transpose, slice, concat, casts through float16/bfloat16,
and reads through computed indices: flip, rotate-half (RoPE's concat of the
negated upper half and the lower half), pad, and take with constant indices
(repeats included).
Values are kept finite by construction (exp of a tanh, log of 1 + |x|, ...).
Left out of the registry's draw: ops whose result is not one tensor
(dropout's pair), and the step functions (`STEP_FUNCTIONS`): piecewise
constant, they turn the few-ulp differences two correct builds may have
into jumps no tolerance tells from a bug; the op sweep (op_sweep.py)
checks them on identical inputs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_stitch.stitch import DEFAULT_FUSION
from tvm_stitch.tools import op_sweep
from tvm_stitch.tools.tolerance import close, tolerance

GUARDED_UNARY = ("exp", "log", "erf", "tanh", "sigmoid", "rsqrt", "sqrt", "abs", "negative", "power")
GUARDED_BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "where")
STEP_FUNCTIONS = ("relax.floor", "relax.ceil", "relax.round", "relax.trunc", "relax.sign",
                  "relax.floor_divide", "relax.floor_mod", "relax.mod")
DOMAIN = {"relax.acosh": 1.5}  # centre of the squashed argument where (0.05, 0.95) is outside the domain
REDUCE = ("sum", "mean", "max", "min")
SHAPE_OPS = ("reshape", "transpose", "slice", "concat", "cast")
GATHER_OPS = ("flip", "rotate_half", "pad", "take")
DIMS = (1, 2, 3, 5, 7, 8, 16, 31, 32, 64, 97, 128, 256, 1000)
OCLGRIND_MAX_ELEMENTS = 1 << 15  # larger graphs run on pocl under --oclgrind: the simulator is slow


@dataclass
class Step:
    op: str
    args: list  # indices into the value list (inputs first, then step results)
    params: dict = field(default_factory=dict)


@dataclass
class Spec:
    inputs: list  # [shape (list; a string names a symbolic dim), dtype]
    steps: list  # Step
    outputs: list  # value indices
    sizes: dict = field(default_factory=dict)  # symbolic dim name -> concrete sizes to run

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "Spec":
        data = json.loads(text)
        data["steps"] = [Step(**s) for s in data["steps"]]
        return Spec(**data)


def _drawn(arity: int, guarded: tuple) -> tuple:
    """The guarded ops of `arity` tensors and the registry's others, less STEP_FUNCTIONS and the ops
    whose result is not one tensor."""
    names = [n for n in op_sweep.elementwise_ops(arity)
             if n not in STEP_FUNCTIONS and n.split(".")[-1] not in guarded and n != "relax.nn.dropout"]
    return guarded + tuple(names)


def unary_ops() -> tuple:
    return _drawn(1, GUARDED_UNARY)


def binary_ops() -> tuple:
    return _drawn(2, GUARDED_BINARY)


# --- building the Relax module ------------------------------------------------------

def _squashed(value, dt: str, centre: float = 0.5):
    """`value` mapped into (centre - 0.45, centre + 0.45) by a tanh."""
    op = relax.op
    return op.add(op.multiply(op.tanh(value), relax.const(0.45, dt)), relax.const(centre, dt))


def _registry_step(bb, step: Step, values: list, dt: str):
    """A registry op's step: its arguments squashed (the first of two kept signed), in float32 (TVM's
    default builds some only for it: the op sweep covers the narrow types), a boolean result as
    `where` between the first argument and its negation (or the second)."""
    args = [values[i] for i in step.args]
    wide = [relax.op.astype(a, "float32") if dt != "float32" else a for a in args]
    centre = DOMAIN.get(step.op, 0.5)
    if len(wide) == 1:
        squashed = [_squashed(wide[0], "float32", centre)]
    else:
        squashed = [relax.op.tanh(wide[0]), _squashed(wide[1], "float32", centre)]
    result = bb.normalize(op_sweep.python_api(step.op)(*squashed))
    if str(result.ty.dtype) == "bool":
        other = args[1] if len(args) > 1 else relax.op.negative(args[0])
        return relax.op.where(result, args[0], other)
    return relax.op.astype(result, dt) if dt != "float32" else result


def _apply(bb, step: Step, values: list, dtype_of):
    op = relax.op
    a = values[step.args[0]]
    dt = dtype_of(a)
    p = step.params
    if step.op.startswith("relax."):
        return _registry_step(bb, step, values, dt)
    if step.op == "exp":
        return op.exp(op.multiply(op.tanh(a), relax.const(3.0, dt)))
    if step.op == "log":
        return op.log(op.add(op.abs(a), relax.const(1.0, dt)))
    if step.op in ("rsqrt", "sqrt"):
        inner = op.add(op.abs(a), relax.const(1.0, dt))
        return op.rsqrt(inner) if step.op == "rsqrt" else op.sqrt(inner)
    if step.op == "power":
        return op.power(op.add(op.abs(a), relax.const(0.5, dt)), relax.const(1.5, dt))
    if step.op in ("erf", "tanh", "sigmoid", "abs", "negative"):
        return getattr(op, step.op)(a)
    if step.op in GUARDED_BINARY:
        b = values[step.args[1]]
        if step.op == "divide":
            return op.divide(a, op.add(op.abs(b), relax.const(1.0, dt)))
        if step.op == "where":
            return op.where(op.greater(a, b), a, b)
        return getattr(op, step.op)(a, b)
    if step.op in REDUCE:
        return getattr(op, step.op)(a, axis=p["axes"], keepdims=p["keepdims"])
    if step.op == "reshape":
        return op.reshape(a, p["shape"])
    if step.op == "transpose":
        return op.permute_dims(a, p["perm"])
    if step.op == "slice":
        return op.strided_slice(a, [p["axis"]], [p["begin"]], [p["end"]])
    if step.op == "concat":
        return op.concat([a, values[step.args[1]]], axis=p["axis"])
    if step.op == "cast":
        return op.astype(op.astype(a, p["via"]), dt)
    if step.op == "flip":
        return op.flip(a, axis=p["axis"])
    if step.op == "rotate_half":
        half = int(a.ty.shape[p["axis"]]) // 2
        upper = op.strided_slice(a, [p["axis"]], [half], [2 * half])
        return op.concat([op.negative(upper), op.strided_slice(a, [p["axis"]], [0], [half])], axis=p["axis"])
    if step.op == "pad":
        widths = [0] * (2 * a.ty.ndim)
        widths[2 * p["axis"]:2 * p["axis"] + 2] = p["widths"]
        return op.nn.pad(a, widths, pad_value=0.0)
    if step.op == "take":
        return op.take(a, relax.const(np.array(p["indices"], "int64")), axis=p["axis"])
    raise ValueError(f"unknown fuzz op {step.op!r}")


def build_module(spec: Spec) -> tvm.IRModule:
    symbols = {}

    def dim(d):
        if isinstance(d, str):
            symbols.setdefault(d, tirx.Var(d, "int64"))
            return symbols[d]
        return d

    params = [relax.Var(f"in{i}", relax.TensorType([dim(d) for d in shape], dtype))
              for i, (shape, dtype) in enumerate(spec.inputs)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            values = list(params)
            for step in spec.steps:
                values.append(bb.emit(_apply(bb, step, values, lambda e: str(e.ty.dtype))))
            outs = [values[i] for i in spec.outputs]
            result = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(result)
    return bb.get()


# --- generating specs ------------------------------------------------------------------

class _Generator:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def pick(self, items):
        return items[int(self.rng.integers(len(items)))]

    def base_shape(self) -> list:
        rank = int(self.rng.integers(1, 5))
        kind = self.pick(["any", "any", "short_rows", "long_rows", "split_rows", "columns"])
        shape = [self.pick(DIMS[:10]) for _ in range(rank)]
        if kind == "short_rows":
            shape[-1] = self.pick([1, 2, 3, 5, 7, 8])
        elif kind == "long_rows":
            shape[-1] = self.pick([1000, 3001, 4096])
            shape[:-1] = [self.pick([1, 2, 3, 5]) for _ in shape[:-1]]
        elif kind == "split_rows":  # few rows too long for one block (CUDA) or for one core (CPU): split
            shape[-1] = self.pick([16384, 20000, 30011, 40000, 65536])
            shape[:-1] = [self.pick([1, 2, 3]) for _ in shape[:-1]]
        elif kind == "columns":  # long leading axis, few columns: column walks split over blocks
            shape = [self.pick([512, 1000, 2048])] + [self.pick([1, 3, 8, 33]) for _ in shape[1:]]
        return shape

    def spec(self, symbolic: bool = False) -> Spec:
        rng = self.rng
        dtype = self.pick(["float32", "float32", "float32", "float16", "bfloat16"])
        shape = self.base_shape()
        inputs = [[list(shape), dtype]]
        if rng.random() < 0.7:
            inputs.append([list(shape), dtype])
        if len(shape) > 1 and rng.random() < 0.6:
            inputs.append([list(shape[int(rng.integers(1, len(shape))):]), dtype])
        shapes = [list(s) for s, _ in inputs]
        steps = []
        for _ in range(int(rng.integers(2, 11))):
            step = self.step(shapes)
            if step is None:
                continue
            shape_out = _result_shape(step, shapes)
            steps.append(step)
            shapes.append(shape_out)
        if not steps:
            steps.append(Step("exp", [0]))
            shapes.append(list(shapes[0]))
        n_values = len(shapes)
        outputs = [n_values - 1]
        for i in range(len(inputs), n_values - 1):
            if rng.random() < 0.15:
                outputs.append(i)
        spec = Spec(inputs, steps, outputs)
        if symbolic:
            spec = _make_symbolic(spec, rng)
        return spec

    def step(self, shapes: list):
        rng = self.rng
        kind = rng.random()
        index = int(rng.integers(len(shapes)))
        shape = shapes[index]
        if kind < 0.35:
            return Step(self.pick(unary_ops()), [index])
        if kind < 0.6:
            partners = [i for i, s in enumerate(shapes) if _broadcastable(s, shape)]
            return Step(self.pick(binary_ops()), [index, self.pick(partners)])
        if kind < 0.85:
            if not shape:
                return None
            rank = len(shape)
            n_axes = 1 if rng.random() < 0.7 or rank == 1 else int(rng.integers(1, rank + 1))
            axes = sorted(int(a) for a in rng.choice(rank, size=n_axes, replace=False))
            return Step(self.pick(REDUCE), [index], {"axes": axes, "keepdims": bool(rng.random() < 0.5)})
        if kind > 0.95:
            return self.gather_step(index, shape)
        op = self.pick(SHAPE_OPS)
        if op == "reshape" and len(shape) >= 2:
            return Step(op, [index], {"shape": shape[:-2] + [shape[-2] * shape[-1]]})
        if op == "reshape" and len(shape) == 1 and shape[0] % 2 == 0:
            return Step(op, [index], {"shape": [2, shape[0] // 2]})
        if op == "transpose" and len(shape) >= 2:
            return Step(op, [index], {"perm": [int(p) for p in rng.permutation(len(shape))]})
        if op == "slice" and shape and max(shape) > 2:
            axis = int(np.argmax(shape))
            begin = int(rng.integers(0, shape[axis] // 2))
            return Step(op, [index], {"axis": axis, "begin": begin, "end": int(rng.integers(begin + 1, shape[axis] + 1))})
        if op == "concat" and shape:
            same = [i for i, s in enumerate(shapes) if s == shape]
            return Step(op, [index, self.pick(same)], {"axis": int(rng.integers(len(shape)))})
        if op == "cast":
            return Step(op, [index], {"via": self.pick(["float16", "bfloat16", "float32"])})
        return Step(self.pick(unary_ops()), [index])

    def gather_step(self, index: int, shape: list):
        """A read through computed indices of a random axis (None for a scalar)."""
        if not shape:
            return None
        rng = self.rng
        axis = int(rng.integers(len(shape)))
        op = self.pick(GATHER_OPS)
        if op == "rotate_half" and shape[axis] % 2 == 0:
            return Step(op, [index], {"axis": axis})
        if op == "pad":
            return Step(op, [index], {"axis": axis, "widths": [int(rng.integers(0, 3)), int(rng.integers(1, 3))]})
        if op == "take":
            count = self.pick([1, shape[axis], max(1, shape[axis] // 2)])
            return Step(op, [index], {"axis": axis, "indices": [int(i) for i in rng.integers(0, shape[axis], count)]})
        return Step("flip", [index], {"axis": axis})


def _broadcastable(small: list, big: list) -> bool:
    if len(small) > len(big):
        return False
    return all(s == b or s == 1 for s, b in zip(small[::-1], big[::-1])) and (
        small == big or len(small) < len(big) or any(s == 1 for s in small)
    )


def _result_shape(step: Step, shapes: list) -> list:
    a = shapes[step.args[0]]
    p = step.params
    if step.op in REDUCE:
        if p["keepdims"]:
            return [1 if i in p["axes"] else d for i, d in enumerate(a)]
        return [d for i, d in enumerate(a) if i not in p["axes"]]
    if step.op == "reshape":
        return list(p["shape"])
    if step.op == "transpose":
        return [a[i] for i in p["perm"]]
    if step.op == "slice":
        out = list(a)
        out[p["axis"]] = p["end"] - p["begin"]
        return out
    if step.op == "concat":
        out = list(a)
        out[p["axis"]] += shapes[step.args[1]][p["axis"]]
        return out
    if step.op in ("pad", "take"):
        out = list(a)
        out[p["axis"]] = a[p["axis"]] + sum(p["widths"]) if step.op == "pad" else len(p["indices"])
        return out
    if len(step.args) == 2:
        b = shapes[step.args[1]]
        return list(a) if len(a) >= len(b) else list(b)
    return list(a)


def _make_symbolic(spec: Spec, rng) -> Spec:
    """Make the leading dim of the full-rank inputs symbolic, when no step depends on its value."""
    first = spec.inputs[0][0]
    if not first or any(s.op in ("reshape", "slice", "concat") for s in spec.steps):
        return spec
    lead = first[0]
    inputs = [[["n"] + shape[1:] if len(shape) == len(first) and shape[0] == lead else shape, dt]
              for shape, dt in spec.inputs]
    steps = []
    for step in spec.steps:
        if step.op in REDUCE and 0 in step.params["axes"] or step.op == "transpose":
            return spec
        if step.op in GATHER_OPS and step.params["axis"] == 0 and step.op != "flip":
            return spec
        steps.append(step)
    return Spec(inputs, steps, spec.outputs, {"n": [1, 3, int(rng.integers(4, 40))]})


def random_spec(seed: int, symbolic: bool | None = None) -> Spec:
    rng = np.random.default_rng(seed)
    if symbolic is None:
        symbolic = bool(rng.random() < 0.1)
    return _Generator(rng).spec(symbolic)


# --- checking -----------------------------------------------------------------------------

def _concrete_inputs(spec: Spec, rng, size: int | None) -> list:
    import ml_dtypes

    arrays = []
    for shape, dtype in spec.inputs:
        concrete = [size if isinstance(d, str) else d for d in shape]
        data = rng.standard_normal(concrete) * 2.0
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
        arrays.append(data.astype(np_dtype))
    return arrays


def _widened(spec: Spec) -> Spec:
    return Spec([[shape, "float32"] for shape, _ in spec.inputs], spec.steps, spec.outputs, spec.sizes)


def _no_less_accurate(got: np.ndarray, default: np.ndarray, exact: np.ndarray, dtype: str) -> bool:
    """Every element of `got` is as close to `exact` as `default` is, up to the dtype's tolerance."""
    got, default, exact = (a.astype(np.float64) for a in (got, default, exact))
    if not (got.shape == default.shape == exact.shape):
        return False
    if not np.array_equal(np.isnan(got), np.isnan(exact)):
        return False
    finite = np.isfinite(got) & np.isfinite(exact)
    rtol, atol = tolerance(dtype)
    tol = atol + rtol * np.abs(exact[finite])
    err_default = np.nan_to_num(np.abs(default[finite] - exact[finite]), nan=np.inf)
    return bool(np.all(np.abs(got[finite] - exact[finite]) <= err_default + tol))


@dataclass
class Outcome:
    ok: bool
    message: str = ""
    stitched_kernels: int = 0
    fallbacks: int = 0
    simt_kernels: int = 0  # stitched CUDA kernels run with SIMT semantics
    simt_platform: str = ""


def _concrete_spec(spec: Spec, size: int) -> Spec:
    inputs = [[[size if isinstance(d, str) else d for d in shape], dtype] for shape, dtype in spec.inputs]
    return Spec(inputs, spec.steps, spec.outputs, {})


def _elements(spec: Spec) -> int:
    return sum(int(np.prod(shape)) for shape, _ in spec.inputs)


def simt_check(spec: Spec, oclgrind: bool = False, seed: int = 0, fusion: str = DEFAULT_FUSION) -> tuple:
    """(Outcome, platform): the stitched CUDA kernels run with SIMT semantics (tvm_stitch.simt).

    Symbolic graphs are built symbolic and their kernels run at each of the
    spec's sizes. Under `oclgrind`, graphs of more than OCLGRIND_MAX_ELEMENTS
    input elements (at their largest size) run on pocl instead (the
    simulator is slow).
    """
    from tvm_stitch import simt

    sizes = spec.sizes.get("n")
    largest = _concrete_spec(spec, max(sizes)) if sizes else spec
    on_oclgrind = oclgrind and _elements(largest) <= OCLGRIND_MAX_ELEMENTS
    report = simt.check(build_module(spec), oclgrind=on_oclgrind, seed=seed, sizes=spec.sizes, fusion=fusion)
    bad = [k for k in report.kernels if not k.ok]
    outcome = Outcome(not bad, "; ".join(f"SIMT {k.status} in {k.name}: {k.detail}" for k in bad[:2]),
                      simt_kernels=len(report.kernels), simt_platform=report.platform)
    return outcome, report.platform


def check_spec(spec: Spec, cuda: bool = False, nvcc: bool = False, seed: int = 0, simt: bool = False,
               oclgrind: bool = False, fusion: str = DEFAULT_FUSION) -> Outcome:
    """Stitched llvm builds (native CPU schedules, and the CUDA schedules without thread
    bindings) vs TVM's default llvm build; optionally the CUDA build compiles, and (`simt`)
    the stitched CUDA kernels run with SIMT semantics on pocl (or Oclgrind). `fusion`: the
    stitched builds' grouping, as `pipeline`'s."""
    from tvm_stitch.tools.build import build, run_cpu

    try:
        mod = build_module(spec)
    except Exception as err:  # noqa: BLE001 - the generator made an invalid graph: skip it
        return Outcome(True, f"skipped: {type(err).__name__}")
    try:
        default = build(mod, {"kind": "llvm"}, stitched=False)
    except Exception as err:  # noqa: BLE001 - TVM itself cannot build it: nothing to compare
        return Outcome(True, f"skipped: default build fails ({type(err).__name__})")
    builds = {}
    for emulate in (None, "cuda"):
        label = "CUDA schedule on llvm" if emulate else "stitched llvm"
        try:
            builds[label] = build(mod, {"kind": "llvm"}, stitched=True, emulate=emulate, fusion=fusion)
        except Exception as err:  # noqa: BLE001
            return Outcome(False, f"{label} build failed: {type(err).__name__}: {_last_line(err)}")
    report = builds["stitched llvm"].report
    dtype = spec.inputs[0][1]
    wide = None
    if dtype != "float32":
        # TVM's default build accumulates float16/bfloat16 sums in that type; the
        # stitched build in float32. The float32 graph says which is right.
        wide = build(build_module(_widened(spec)), {"kind": "llvm"}, stitched=False)
    sizes = spec.sizes.get("n", [None])
    rng = np.random.default_rng(seed)
    for size in sizes:
        inputs = _concrete_inputs(spec, rng, size)
        want = run_cpu(default.executable, inputs)
        exact = run_cpu(wide.executable, [a.astype(np.float32) for a in inputs]) if wide else want
        for label, built in builds.items():
            got = run_cpu(built.executable, inputs)
            for k, (g, w, e) in enumerate(zip(got, want, exact)):
                if not (close(g, w, dtype) or _no_less_accurate(g, w, e, dtype)):
                    err = (np.nanmax(np.abs(g.astype(np.float64) - w.astype(np.float64)))
                           if g.shape == w.shape else "shape")
                    return Outcome(False, f"{label}: output {k} differs (size {size}): max abs diff {err}")
    if cuda:
        try:
            built = build(mod, {"kind": "cuda", "arch": "sm_90"}, stitched=True, fusion=fusion)
            if nvcc:
                _nvcc_check(built.executable)
        except Exception as err:  # noqa: BLE001
            return Outcome(False, f"CUDA build failed: {type(err).__name__}: {_last_line(err)}")
    outcome = Outcome(True, "", len(report.plans), len(report.fallbacks))
    if simt:
        checked, _ = simt_check(spec, oclgrind, seed, fusion)
        outcome.simt_kernels, outcome.simt_platform = checked.simt_kernels, checked.simt_platform
        if not checked.ok:
            return dataclasses.replace(outcome, ok=False, message=checked.message)
    return outcome


def _last_line(err) -> str:
    lines = str(err).strip().splitlines()
    return lines[-1][:300] if lines else ""


def _nvcc_check(executable) -> None:
    import shutil
    import subprocess
    import tempfile

    from tvm_stitch.tools.launches import cuda_source

    nvcc = shutil.which("nvcc")
    source = cuda_source(executable)
    if nvcc is None or not source:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.cu"
        with open(path, "w", encoding="utf-8") as out:
            out.write(source)
        result = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", f"{tmp}/k.cubin", path],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc: {result.stderr.strip().splitlines()[-1][:300]}")


def shrink(spec: Spec, still_fails) -> Spec:
    """A smaller spec that still fails: drop steps (and outputs) while the failure remains."""
    current = spec
    changed = True
    while changed:
        changed = False
        for i in range(len(current.steps) - 1, -1, -1):
            candidate = _without_step(current, i)
            if candidate is not None and still_fails(candidate):
                current, changed = candidate, True
                break
        if len(current.outputs) > 1:
            for k in range(len(current.outputs)):
                candidate = Spec(current.inputs, current.steps, current.outputs[:k] + current.outputs[k + 1:],
                                 current.sizes)
                if still_fails(candidate):
                    current, changed = candidate, True
                    break
    return current


def _without_step(spec: Spec, index: int):
    """The spec without step `index`; its users read the step's first argument instead.

    A user whose shape no longer fits makes the graph invalid; the checker
    then skips it and the shrinker keeps the step.
    """
    n_in = len(spec.inputs)
    removed = n_in + index
    replacement = spec.steps[index].args[0]

    def remap(v):
        if v == removed:
            return replacement
        return v - 1 if v > removed else v

    steps = [Step(s.op, [remap(a) for a in s.args], dict(s.params))
             for k, s in enumerate(spec.steps) if k != index]
    outputs = sorted({remap(o) for o in spec.outputs})
    return Spec(spec.inputs, steps, outputs, spec.sizes)


def fuzz(n: int, seed: int, cuda: bool = False, nvcc_every: int = 0, progress=None,
         on_failure=None, simt: bool = False, oclgrind: bool = False) -> dict:
    """Check `n` random graphs from seeds seed..seed+n-1; returns counts and failures.

    `simt` also runs each graph's stitched CUDA kernels on pocl (`oclgrind`: on
    Oclgrind, for graphs of at most OCLGRIND_MAX_ELEMENTS input elements).
    """
    start = time.perf_counter()
    summary = {"graphs": 0, "skipped": 0, "stitched_kernels": 0, "fallbacks": 0, "failures": []}
    if simt:
        summary.update(simt_kernels=0, simt_oclgrind_graphs=0)
    for s in range(seed, seed + n):
        spec = random_spec(s)
        nvcc = bool(nvcc_every) and (s - seed) % nvcc_every == 0
        outcome = check_spec(spec, cuda=cuda, nvcc=nvcc, seed=s, simt=simt, oclgrind=oclgrind)
        summary["graphs"] += 1
        if outcome.message.startswith("skipped"):
            summary["skipped"] += 1
        summary["stitched_kernels"] += outcome.stitched_kernels
        summary["fallbacks"] += outcome.fallbacks
        if simt:
            summary["simt_kernels"] += outcome.simt_kernels
            summary["simt_oclgrind_graphs"] += outcome.simt_platform.startswith("Oclgrind")
        if not outcome.ok:
            small = shrink(spec, lambda c: not check_spec(c, cuda=cuda, seed=s, simt=simt, oclgrind=oclgrind).ok)
            failure = {"seed": s, "message": outcome.message, "spec": small.to_json()}
            summary["failures"].append(failure)
            if on_failure is not None:
                on_failure(failure)
        if progress is not None:
            progress(s - seed + 1, n, summary)
    summary["seconds"] = time.perf_counter() - start
    return summary
