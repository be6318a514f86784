"""Counting CUDA kernel launches of a built Relax module, and its modeled traffic.

Launches per forward = for every call of a PrimFunc in the lowered Relax
functions, the number of CUDA kernels TVM generated for that PrimFunc
(`<name>_kernel`, `<name>_kernel_1`, ...), read from the CUDA source.
"""

from __future__ import annotations

import re
from collections import Counter

import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.size_bounds import size_bounds
from tvm_stitch.analysis.tir_view import static_product
from tvm_stitch.pricing.traffic import modeled_traffic
from tvm_stitch.kernels.variants import launches_at
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import as_target

_KERNEL = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\(\d+(?:, \d+)?\))? (\w+)\(')


def cuda_module(executable):
    """The CUDA module inside a built executable, or None."""
    stack = [executable.mod if hasattr(executable, "mod") else executable]
    while stack:
        module = stack.pop()
        if module.kind == "cuda":
            return module
        stack.extend(module.imports)
    return None


def cuda_source(executable) -> str:
    module = cuda_module(executable)
    return module.inspect_source("") if module is not None else ""


def kernels_per_primfunc(source: str, names) -> dict:
    """Kernel count per PrimFunc name, from the generated CUDA source."""
    kernels = set(_KERNEL.findall(source))
    counts = {}
    for name in names:
        pattern = re.compile(rf"^{re.escape(name)}_kernel(_\d+)?$")
        counts[name] = sum(1 for k in kernels if pattern.match(k))
    return counts


def primfunc_calls(lowered: tvm.IRModule) -> Counter:
    """How often each PrimFunc is called by the lowered Relax functions."""
    prim_names = {gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)}
    calls: Counter = Counter()

    def visit(expr):
        if isinstance(expr, relax.Call):
            if isinstance(expr.op, tvm.ir.GlobalVar) and expr.op.name_hint in prim_names:
                calls[expr.op.name_hint] += 1
            for arg in expr.args:
                visit(arg)
        elif isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    visit(binding.value)
            visit(expr.body)
        elif isinstance(expr, relax.If):
            visit(expr.true_branch)
            visit(expr.false_branch)
        elif isinstance(expr, relax.Tuple):
            for field in expr.fields:
                visit(field)
        elif isinstance(expr, tvm.ir.GlobalVar) and expr.name_hint in prim_names:
            calls[expr.name_hint] += 1

    for _, func in lowered.functions_items():
        if isinstance(func, relax.Function):
            visit(func.body)
    return calls


def launches_per_call(lowered: tvm.IRModule, executable, calls) -> dict:
    """Kernels per call of each PrimFunc named in `calls`: those TVM generated for it, or, for one
    choosing among size variants (kernels/variants.py), those of the variant that runs at the upper
    bound of its size (of the variant for every size where it has none)."""
    per_func = kernels_per_primfunc(cuda_source(executable), calls)
    for name in calls:
        func = lowered[name]
        upper = [high for _, high in size_bounds(func).values()] if isinstance(func, tirx.PrimFunc) else []
        chosen = launches_at(func, upper[0] if len(upper) == 1 else None) if isinstance(func, tirx.PrimFunc) else None
        if chosen is not None:
            per_func[name] = chosen
    return per_func


def count_launches(lowered: tvm.IRModule, executable) -> int:
    """CUDA kernel launches of one call of every Relax function (one forward)."""
    calls = primfunc_calls(lowered)
    per_func = launches_per_call(lowered, executable, calls)
    return sum(calls[name] * per_func[name] for name in calls)


def launches_by_kind(lowered: tvm.IRModule, executable) -> tuple:
    """(memory-intensive launches, compute-intensive launches) per call of every Relax function.

    Stitched and packed kernels are memory-intensive by construction; any
    other kernel is compute-intensive when one of its blocks contracts two
    tensors (matmul, conv, with whatever epilogue TVM fused in).
    """
    from tvm_stitch.analysis.classify import is_compute_kernel

    calls = primfunc_calls(lowered)
    per_func = launches_per_call(lowered, executable, calls)
    memory = compute = 0
    for name, count in calls.items():
        launches = count * per_func[name]
        attrs = lowered[name].attrs
        stitched = attrs is not None and ("tvm_stitch.plan" in attrs or "tvm_stitch.packed" in attrs)
        if not stitched and is_compute_kernel(lowered[name]):
            compute += launches
        else:
            memory += launches
    return memory, compute


def program_traffic(lowered: tvm.IRModule, target) -> tuple:
    """(modeled bytes of one call of every Relax function, ideal bytes of `main`'s signature),
    for the target (a Target, dict or string) the module was built for.

    Modeled: for every PrimFunc call, that PrimFunc's modeled traffic. Ideal:
    `main`'s tensor inputs read once and its outputs written once.
    """
    spec = TargetSpec.from_target(as_target(target))
    calls = primfunc_calls(lowered)
    modeled = 0
    for gv, func in lowered.functions_items():
        if gv.name_hint in calls:
            traffic = modeled_traffic(func, spec)
            if traffic is None:
                return -1, -1
            modeled += calls[gv.name_hint] * traffic.total
    main = lowered["main"]
    tensors = [p.ty for p in main.params] + _leaves(main.ret_ty)
    ideal = 0
    for ty in tensors:
        if isinstance(ty, relax.TensorType) and ty.shape is not None:
            size = static_product(list(ty.shape))
            if size is None:
                return modeled, -1
            ideal += size * max(1, tvm.DataType(str(ty.dtype)).bits // 8)
    return modeled, ideal


def _leaves(ty) -> list:
    if isinstance(ty, relax.TupleType):
        return [leaf for field in ty.fields for leaf in _leaves(field)]
    return [ty]
