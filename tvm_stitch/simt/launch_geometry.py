"""The launches of a lowered PrimFunc, in order, read from TVM's host function.

After TVM's TIR pipeline splits a scheduled PrimFunc into host and device
functions, the host function holds one `call_ffi_kernel` per device kernel
(a row-split PrimFunc has one per phase), with the kernel's arguments and
its grid and block extents, which come from the scheduled TIR's
`thread_binding` loops. Global intermediates (row-split partials) are
allocations of the host function: TVM's runtime gives them device
workspace, uninitialised. This module reads those facts; it runs nothing.

For a kernel of symbolic shape the extents, scalar arguments and workspace
sizes are expressions of the PrimFunc's symbolic variables (the host's
own bindings substituted); `LaunchPlan.at` gives their values at one size.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx

from tvm_stitch.simt.symbolic_sizes import concrete

_AXES = ("x", "y", "z")


class UnsupportedLaunch(ValueError):
    """A launch this checker cannot reproduce (e.g. dynamic shared memory, extents of unknown values)."""


@dataclass(frozen=True)
class Workspace:
    """A global buffer the host allocates for the kernels (TVM: device workspace)."""

    name: str
    dtype: str
    elements: object  # int, or an expression of the symbolic variables


@dataclass(frozen=True)
class Launch:
    """One kernel launch: arguments are ("param", index), ("workspace", index) or ("scalar", value).

    Scalar values and extents are ints, or expressions of the symbolic variables.
    """

    kernel: str
    args: tuple
    grid: tuple  # blocks in x, y, z
    block: tuple  # threads in x, y, z


@dataclass(frozen=True)
class LaunchPlan:
    launches: tuple
    workspaces: tuple

    def at(self, values: dict) -> "LaunchPlan":
        """The plan with every expression evaluated at `values` (symbolic variable name -> int)."""

        def value(expr, what):
            try:
                return concrete(expr, values)
            except ValueError as err:
                raise UnsupportedLaunch(f"{what}: {err}") from None

        launches = tuple(Launch(
            launch.kernel,
            tuple((kind, value(v, f"{launch.kernel}: scalar argument") if kind == "scalar" else v)
                  for kind, v in launch.args),
            tuple(value(g, f"{launch.kernel}: grid") for g in launch.grid),
            tuple(value(b, f"{launch.kernel}: block") for b in launch.block)) for launch in self.launches)
        workspaces = tuple(Workspace(w.name, w.dtype, value(w.elements, f"workspace {w.name}"))
                           for w in self.workspaces)
        return LaunchPlan(launches, workspaces)


def _statements(stmt) -> list:
    seen = []
    tvm_ffi.structural_walk(stmt, (tirx.Stmt, seen.append), order="pre")
    return seen


def _symbolic_vars(params: list) -> list:
    """The variables a caller gives values for: those of the parameter shapes, and scalar parameters."""
    found = []
    for param in params:
        dims = param.ty.shape if isinstance(param.ty, tirx.BufferType) else [param]
        for dim in dims:
            found.extend(tvm.tirx.analysis.undefined_vars(dim, []))
    return found


def _resolver(binds: list, keep: list):
    """expr -> expr with the host's bound variables replaced by their values, except those of `keep`."""

    def resolve(expr, depth=0):
        if isinstance(expr, tirx.IntImm) or depth > 16:
            return expr
        mapping = {}
        for var in tvm.tirx.analysis.undefined_vars(expr, []):
            if _index(var, keep) is not None:
                continue
            value = next((v for b, v in reversed(binds) if b.same_as(var)), None)
            if value is not None:
                mapping[var] = resolve(value, depth + 1)
        if not mapping:
            return expr
        return tvm_ffi.structural_map(expr, (tirx.Var, lambda v: next(
            (value for var, value in mapping.items() if var.same_as(v)), v)))

    return resolve


def launch_plan(host: tirx.PrimFunc, params: list, kernel_arity: dict) -> LaunchPlan:
    """The launches of `host` (the lowered host function of a PrimFunc with parameters `params`).

    `kernel_arity`: device kernel name -> its number of parameters (the
    `call_ffi_kernel` arguments after them are the launch extents).
    """
    binds = []  # (var, value) of the host's Bind statements
    declared = []  # (buffer, data expression) of DeclBuffers of packed arguments
    alias = []  # (flattened buffer var, the buffer it views)
    allocated = []  # workspace buffer vars, in the order of `workspaces`
    workspaces, launches = [], []
    resolve = _resolver(binds, _symbolic_vars(params))
    for stmt in _statements(host.body):
        kind = type(stmt).__name__
        if kind == "Bind":
            binds.append((stmt.var, stmt.value))
        elif kind == "DeclBuffer":
            data = stmt.data
            if _is_buffer_data(data):
                alias.append((stmt.buffer, data.args[0]))
            else:
                declared.append((stmt.buffer, data))
        elif kind == "AllocBuffer":
            ty = stmt.buffer.ty
            if str(ty.storage_scope) not in ("global", ""):
                raise UnsupportedLaunch(f"host allocation {stmt.buffer} in scope {ty.storage_scope}")
            elements = 1
            for dim in ty.shape:
                elements = elements * dim
            allocated.append(stmt.buffer)
            workspaces.append(Workspace(str(stmt.buffer.name), str(ty.dtype), _static(resolve(elements))))
        elif kind == "Evaluate" and _is_kernel_call(stmt.value):
            launches.append(_launch(stmt.value, params, alias, allocated, kernel_arity,
                                    _argument_position(host, binds, declared), resolve))
    return LaunchPlan(tuple(launches), tuple(workspaces))


def _static(expr):
    """An int where `expr` is a constant, else `expr`."""
    return int(expr.value) if isinstance(expr, tirx.IntImm) else int(expr) if isinstance(expr, int) else expr


def _is_buffer_data(expr) -> bool:
    return type(expr).__name__ == "Call" and getattr(expr.op, "name", "") == "tirx.buffer_data"


def _is_kernel_call(expr) -> bool:
    return type(expr).__name__ == "Call" and getattr(expr.op, "name", "") == "tirx.call_ffi_kernel"


def _index(var, variables: list):
    """Position of `var` in `variables` by identity (TVM variables compare by name otherwise)."""
    return next((i for i, v in enumerate(variables) if v.same_as(var)), None)


def _argument_position(host: tirx.PrimFunc, binds: list, declared: list):
    """buffer -> position among the packed arguments, for a buffer the host declares from them.

    Used when a pass replaced a parameter's variable (BF16StorageLegalize
    stores bfloat16 as uint16): the host still reads its data pointer from
    `tvm_struct_get(args, position, ...)`, possibly through bound variables.
    """
    args = host.params[1] if len(host.params) > 1 else None

    def position(expr, depth=0):
        found = []

        def visit(call):
            if getattr(call.op, "name", "") != "tirx.tvm_struct_get" or not found == []:
                return
            base = call.args[0]
            if args is not None and base.same_as(args):
                found.append(int(call.args[1].value))
            elif depth < 4:
                value = next((v for var, v in binds if var.same_as(base)), None)
                if value is not None and (k := position(value, depth + 1)) is not None:
                    found.append(k)

        tvm_ffi.structural_walk(expr, (tvm.ir.Call, visit), order="pre")
        return found[0] if found else None

    def of(buffer):
        data = next((d for b, d in declared if b.same_as(buffer)), None)
        return position(data) if data is not None else None

    return of


def _launch(call, params: list, alias: list, allocated: list, kernel_arity: dict, argument_position,
            resolve) -> Launch:
    name = str(call.args[0].value)
    arity = kernel_arity[name]
    values, extents = list(call.args[1: 1 + arity]), list(call.args[1 + arity:])
    tags = [str(t) for t in call.attrs.launch_params]
    if "tirx.use_dyn_shared_memory" in tags:
        raise UnsupportedLaunch(f"{name} uses dynamic shared memory")
    args = []
    for value in values:
        if _is_buffer_data(value):
            buffer = value.args[0]
            while (k := _index(buffer, [a for a, _ in alias])) is not None:
                buffer = alias[k][1]
            index, workspace = _index(buffer, params), _index(buffer, allocated)
            if index is None and workspace is None:
                index = argument_position(buffer)
            if index is not None:
                args.append(("param", index))
            elif workspace is not None:
                args.append(("workspace", workspace))
            else:
                raise UnsupportedLaunch(f"{name}: argument {buffer} is neither a parameter nor a workspace")
        else:
            args.append(("scalar", _static(resolve(value))))
    grid, block = [1, 1, 1], [1, 1, 1]
    for tag, extent in zip(tags, extents):
        scope, _, axis = tag.partition(".")
        target = grid if scope == "blockIdx" else block if scope == "threadIdx" else None
        if target is None or axis not in _AXES:
            raise UnsupportedLaunch(f"{name}: unknown launch parameter {tag}")
        target[_AXES.index(axis)] = _static(resolve(extent))
    return Launch(name, tuple(args), tuple(grid), tuple(block))
