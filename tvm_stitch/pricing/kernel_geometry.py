"""The launch geometry of each CUDA kernel of a scheduled PrimFunc: the time model's input.

The PrimFunc (ours or one dlight scheduled) is lowered by TVM's TIR
pipeline for the target, as kernels/builds.py does, and each device kernel
is read as a thread runs it:
- grid and block: its `thread_extent` attributes (static, else UnsupportedGeometry);
- a loop whose extent depends on the block or thread index (a causal
  attention's key tiles up to the diagonal): the mean of its extent's bounds
  over the launch, exact where the extent is affine in one index;
- global loads and stores: each access site of a buffer in global scope,
  its width (the lanes of its dtype) and how often a thread reaches it (the
  product of the loops around it; branches counted as taken);
- load sites that can be in flight at once: the sites, an unrolled loop's
  body counted once per iteration, a serial loop's SERIAL_UNROLL times;
- barriers (`tvm_storage_sync`) and the barrier-separated phases that load
  from global memory; serial loop iterations; special-function calls
  weighted by planning/time_model.SFU_COST, per lane;
- static shared memory: the block's shared allocations;
- arithmetic (pricing/arithmetic.py): floating-point operations per thread
  by math unit: FMA-pipe adds and multiplies by dtype, per lane, and the
  tensor cores' mma instructions by their shape and input dtype.
Registers are not in the TIR: the caller passes the plan's estimate (or
ptxas' count); time_model.DEFAULT_REGISTERS otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import sym, tirx
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods

from schedules.cuda.combine_in_launch import COMBINING_ATTR
from tvm_stitch.planning.time_model import DEFAULT_REGISTERS, SERIAL_UNROLL, SFU_COST, KernelGeometry
from tvm_stitch.pricing.arithmetic import ARITHMETIC, MMA_OPS, add_arithmetic

_ON_CHIP = ("shared", "shared.dyn", "local", "warp")
ATOMICS = ("tirx.cuda.atomic_add",)  # atomic adds to an address (`address_of(buffer[...])`), value


class UnsupportedGeometry(ValueError):
    """A kernel whose geometry this reader cannot give (a symbolic extent, loop or size)."""


def device_kernels(func: tirx.PrimFunc, target: Target, name: str = "") -> list:
    """(name, kernel) of each device kernel of a scheduled PrimFunc lowered for a CUDA `target`,
    in launch order; `name` (default: the function's global symbol, else "main") is the stem."""
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    name = name or (str(symbol) if symbol else "main")
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    lower, _, _ = tvm.tirx.get_default_tir_pipeline(target)
    _, device_mods = split_host_device_mods(lower(tvm.tirx.transform.BindTarget(
        target.with_host(Target("llvm")))(mod)))
    kernels = [(gv.name_hint, f) for device in device_mods.values() for gv, f in device.functions_items()
               if isinstance(f, tirx.PrimFunc)]

    def order(item):
        match = re.search(r"_kernel(?:_(\d+))?$", item[0])
        return int(match.group(1) or 0) if match else 0

    return sorted(kernels, key=order)


@dataclass
class _Walk:
    """What one thread does, accumulated while walking a kernel's body."""

    grid: int = 1
    threads: int = 1
    loads: dict = field(default_factory=dict)  # width -> accesses per thread
    stores: dict = field(default_factory=dict)
    sites: float = 0.0
    phases: int = 0
    loading: bool = False  # the current barrier-separated phase has a global load
    barriers: int = 0
    serial: int = 0
    sfu: float = 0.0
    flops: dict = field(default_factory=dict)  # math unit -> operations per thread
    shared: int = 0
    ranges: sym.Analyzer = field(default_factory=sym.Analyzer)  # launch and loop variables bound so far
    block: object = None  # the blockIdx.x variable, once its launch is seen
    members: list = field(default_factory=list)  # a packed launch's members: (blocks, _Walk) each
    combining: tuple = ()  # (blocks, _Walk) of a branch the last blocks run after all others arrive


def _static(expr, what: str) -> int:
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, int):
        return expr
    raise UnsupportedGeometry(f"{what} is not static: {expr}")


def _launch_mean(walk: _Walk, expr, what: str) -> int:
    """A loop extent over the launch: static, else the mean of its bounds given the thread and
    block indices, loop variables and bindings around it."""
    if isinstance(expr, (int, tirx.IntImm)):
        return _static(expr, what)
    bound = walk.ranges.const_int_bound(expr)
    if bound.max_value - bound.min_value > 1 << 30:
        raise UnsupportedGeometry(f"{what} is not bounded over the launch: {expr}")
    return max(0, (int(bound.min_value) + int(bound.max_value) + 1) // 2)


def _width(ty) -> int:
    dtype = tvm.DataType(str(ty.dtype))
    return max(1, dtype.bits * dtype.lanes // 8)


def _global(buffer) -> bool:
    return str(buffer.scope()) not in _ON_CHIP


def _expressions(walk: _Walk, expr, times: int, sites: float) -> None:
    """Loads and special functions of one expression evaluated `times` times per thread."""
    if isinstance(expr, (tirx.Var, tirx.IntImm, tirx.FloatImm)):
        return  # a leaf: neither a load nor a call

    def visit(node):
        kind = type(node).__name__
        if kind == "TensorLoad" and _global(node.source):
            width = _width(node.ty)
            walk.loads[width] = walk.loads.get(width, 0) + times
            walk.sites += sites
            walk.loading = True
        elif kind == "Call":
            op = getattr(node.op, "name", "")
            if op in ATOMICS:  # a reduction at the L2 whose result the thread does not wait for: a store
                width = _width(node.ty)
                walk.stores[width] = walk.stores.get(width, 0) + times
                for index in node.args[0].args[0].indices:  # the address: its indices' loads, not the element
                    _expressions(walk, index, times, sites)
                _expressions(walk, node.args[1], times, sites)
                return tvm_ffi.WalkResult.SKIP
            if op == "tirx.tvm_storage_sync":
                walk.barriers += times
                walk.phases += times if walk.loading else 0
                walk.loading = False
            elif op.startswith("tirx.") and op[5:] in SFU_COST:
                walk.sfu += times * SFU_COST[op[5:]] * tvm.DataType(str(node.ty.dtype)).lanes
            elif op in MMA_OPS:
                add_arithmetic(walk.flops, node, times)
        elif isinstance(node, ARITHMETIC):
            add_arithmetic(walk.flops, node, times)

    tvm_ffi.structural_walk(expr, ((tvm.ir.TensorLoad, tvm.ir.Call) + ARITHMETIC, visit), order="pre")


def _stmt(walk: _Walk, stmt, times: int, sites: float) -> None:
    kind = type(stmt).__name__
    if kind == "SeqStmt":
        for child in stmt.seq:
            _stmt(walk, child, times, sites)
    elif kind == "AttrStmt":
        if stmt.attr_key == COMBINING_ATTR:
            walk.combining = (_static(stmt.value, COMBINING_ATTR), _branch(walk, stmt.body, times, sites))
            return
        if stmt.attr_key == "thread_extent":
            extent = _static(stmt.value, f"extent of {stmt.node.thread_tag}")
            walk.ranges.bind(stmt.node.var, tvm.ir.Range(0, extent), allow_override=True)
            if stmt.node.thread_tag.startswith("blockIdx"):
                walk.grid *= extent
                walk.block = stmt.node.var if stmt.node.thread_tag == "blockIdx.x" else walk.block
            else:
                walk.threads *= extent
        else:
            _expressions(walk, stmt.value, times, sites)
        _stmt(walk, stmt.body, times, sites)
    elif kind == "For":
        extent = _launch_mean(walk, stmt.extent, f"loop {stmt.loop_var}")
        walk.ranges.bind(stmt.loop_var, tvm.ir.Range.from_min_extent(stmt.min, max(extent, 1)), allow_override=True)
        unrolled = stmt.kind == tirx.ForKind.UNROLLED
        if not unrolled:
            walk.serial += times * extent
        _stmt(walk, stmt.body, times * extent, sites * (extent if unrolled else min(extent, SERIAL_UNROLL)))
    elif kind == "IfThenElse":
        _expressions(walk, stmt.condition, times, sites)
        if stmt.else_case is None:
            _stmt(walk, stmt.then_case, times, sites)  # a predicate: counted as taken
        else:
            chain = _block_ranges(walk, stmt)
            branches = [_branch(walk, case, times, sites) for _, case in chain] if chain else \
                [_branch(walk, case, times, sites) for case in (stmt.then_case, stmt.else_case)]
            if chain and not walk.members:
                walk.members = [(blocks, _joined(walk, branch)) for (blocks, _), branch in zip(chain, branches)]
            _either(walk, branches)
    elif kind == "AllocBuffer":
        buffer = stmt.buffer
        if str(buffer.scope()).startswith("shared"):
            elements = 1
            for dim in buffer.shape:
                elements *= _static(dim, f"shape of {buffer.name}")
            walk.shared += elements * max(1, tvm.DataType(str(buffer.dtype)).bits // 8)
    elif kind == "BufferStore":
        _expressions(walk, stmt.value, times, sites)
        for index in stmt.indices:
            _expressions(walk, index, times, sites)
        if _global(stmt.buffer):
            width = _width(stmt.value.ty)
            walk.stores[width] = walk.stores.get(width, 0) + times
    elif kind in ("Evaluate", "Bind", "AssertStmt"):
        if kind == "Bind":
            walk.ranges.bind(stmt.var, stmt.value, allow_override=True)
        _expressions(walk, stmt.value if kind != "AssertStmt" else stmt.condition, times, sites)
    elif kind != "DeclBuffer":
        for child in ("body", "then_case", "else_case"):
            if isinstance(getattr(stmt, child, None), tirx.Stmt):
                _stmt(walk, getattr(stmt, child), times, sites)


def _block_ranges(walk: _Walk, stmt) -> list:
    """(blocks, body) of each member of a packed launch: an if-else chain `blockIdx.x < end`
    over static ends, the last member's body the final else; [] for any other if-else."""
    chain, start = [], 0
    while isinstance(stmt, tirx.IfThenElse) and stmt.else_case is not None:
        cond = stmt.condition
        if walk.block is None or not isinstance(cond, tirx.LT) or not cond.a.same_as(walk.block) \
                or not isinstance(cond.b, tirx.IntImm) or cond.b.value <= start:
            return []
        chain.append((cond.b.value - start, stmt.then_case))
        start = cond.b.value
        stmt = stmt.else_case
    if walk.grid <= start:
        return []
    return chain + [(walk.grid - start, stmt)]


def _branch(walk: _Walk, stmt, times: int, sites: float) -> _Walk:
    """What one branch of an if-else does, walked apart (it sees the extents found so far)."""
    apart = _Walk(grid=walk.grid, threads=walk.threads, loading=walk.loading, ranges=walk.ranges,
                  block=walk.block)
    _stmt(apart, stmt, times, sites)
    return apart


def _joined(walk: _Walk, branch: _Walk) -> _Walk:
    """What a thread that takes `branch` does in all: `walk` so far, then the branch."""
    joined = dataclasses.replace(walk, loads=dict(walk.loads), stores=dict(walk.stores), flops=dict(walk.flops),
                                 members=[])
    _either(joined, [branch])
    return joined


def _either(walk: _Walk, branches: list) -> None:
    """Add to `walk` the most of each count over exclusive branches (the kernels sharing a packed
    launch are an if-else chain over the block index: a thread runs one of them)."""
    for counts in ("loads", "stores", "flops"):
        merged = getattr(walk, counts)
        for width in {w for b in branches for w in getattr(b, counts)}:
            merged[width] = merged.get(width, 0) + max(getattr(b, counts).get(width, 0) for b in branches)
    for count in ("sites", "phases", "barriers", "serial", "sfu", "shared"):
        setattr(walk, count, getattr(walk, count) + max(getattr(b, count) for b in branches))
    walk.grid, walk.threads = max(b.grid for b in branches), max(b.threads for b in branches)
    walk.loading = any(b.loading for b in branches)


def kernel_geometry(name: str, kernel: tirx.PrimFunc, registers: int = -1, dram_bytes: int = -1) -> KernelGeometry:
    """The geometry of one lowered device kernel; a packed launch's also has each member's, on
    its range of blocks (`members`)."""
    walk = _Walk()
    _stmt(walk, kernel.body, 1, 1.0)
    if walk.combining:  # priced as two members: every block's work, then the combining blocks'
        blocks, branch = walk.combining
        alone = _joined(walk, _Walk(grid=walk.grid, threads=walk.threads))
        walk = _joined(walk, branch)
        walk.members = [(alone.grid, alone), (blocks, branch)]
    whole = _geometry(name, walk, registers, dram_bytes)
    members = tuple(_geometry(f"{name}[{k}]", dataclasses.replace(member, grid=blocks, threads=walk.threads),
                              registers, -1) for k, (blocks, member) in enumerate(walk.members))
    return dataclasses.replace(whole, members=members)


def _geometry(name: str, walk: _Walk, registers: int, dram_bytes: int) -> KernelGeometry:
    phases = walk.phases + (1 if walk.loading else 0)
    return KernelGeometry(
        name=name, grid=walk.grid, threads=walk.threads,
        loads=tuple(sorted(walk.loads.items())), stores=tuple(sorted(walk.stores.items())),
        load_sites=int(round(walk.sites)), load_phases=phases, barriers=walk.barriers,
        serial_iterations=walk.serial, sfu_ops=walk.sfu, flops=tuple(sorted(walk.flops.items())),
        registers=registers if registers > 0 else DEFAULT_REGISTERS, shared_bytes=walk.shared,
        dram_bytes=dram_bytes)


def kernel_geometries(func: tirx.PrimFunc, target: Target, registers: int = -1, dram_bytes: int = -1,
                      name: str = "") -> list:
    """The geometry of every kernel of a scheduled PrimFunc; `dram_bytes` (the PrimFunc's modeled
    traffic, -1 for none) is shared among its kernels in proportion to the bytes they access."""
    found = [kernel_geometry(k, kernel, registers) for k, kernel in device_kernels(func, target, name)]
    return with_dram_bytes(found, dram_bytes)


def with_dram_bytes(found: list, dram_bytes: int) -> list:
    """The geometries of one PrimFunc's kernels with `dram_bytes` (its modeled traffic, -1 for
    none: left as they are) shared among them in proportion to the bytes they access."""
    accessed = sum(g.accessed_bytes for g in found)
    if dram_bytes < 0 or not accessed:
        return found
    return [dataclasses.replace(g, dram_bytes=dram_bytes * g.accessed_bytes // accessed) for g in found]
