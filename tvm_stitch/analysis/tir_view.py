"""A read-only view of the blocks of a PrimFunc: iterators, accesses, expensive ops.

Every analysis in tvm-stitch (classification, row alignment, traffic) reads
PrimFuncs through this one view, so the walking of TIR lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import get_root_block

# Intrinsics whose cost per element is far above a load: evaluated once per
# element by a stitched kernel, never recomputed.
EXPENSIVE_INTRINSICS = frozenset(
    {
        "exp", "exp2", "exp10", "expm1", "log", "log2", "log10", "log1p",
        "erf", "tanh", "sigmoid", "sqrt", "rsqrt", "pow", "sin", "cos", "tan",
        "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
    }
)


POINT = "point"  # one element, at indices computed from the block's iterators alone
GATHER = "gather"  # through loaded indices (a `take`), or a region one load does not cover (a concat's or
# pad's guarded loads, two halves of a row): one access per index tuple the body loads it at
REGION = "region"  # a region no load of the body describes (an opaque access): not describable


@dataclass(frozen=True)
class Access:
    """One buffer access of a block: the buffer, its per-dimension index and its kind.

    A gather (a `take`, a concat's or pad's guarded load, a rotated half) is
    one access per distinct index tuple the body loads the buffer at; each
    index may hold arithmetic, conditions' operands and loads of other buffers.
    """

    buffer: tirx.Buffer
    indices: tuple  # PrimExpr per dimension
    kind: str  # POINT, GATHER or REGION


@dataclass(frozen=True)
class BlockView:
    """A block with the facts the planner needs."""

    name: str
    iter_vars: tuple  # tirx.Var per block iterator
    extents: tuple  # PrimExpr per block iterator
    is_reduce: tuple  # bool per block iterator
    reads: tuple  # Access
    writes: tuple  # Access
    expensive: tuple  # names of expensive intrinsics in the body
    trivial_binding: bool  # block iterators are bound one-to-one to its loops
    loads: tuple  # (buffer, number of loads of it in the body)

    def loads_of(self, buffer) -> int:
        return sum(n for b, n in self.loads if b.same_as(buffer))

    @property
    def has_reduction(self) -> bool:
        return any(self.is_reduce)


# Expressions without sub-expressions (most indices): read directly, not walked.
_LEAVES = (tirx.Var, tirx.IntImm)


def node_count(node) -> int:
    """Nodes of an expression or statement, each occurrence counted (as a tree)."""
    count = [0]
    tvm_ffi.structural_walk(node, lambda _node: count.__setitem__(0, count[0] + 1), order="pre")
    return count[0]


def _accesses(region, body, analyzer) -> list:
    """The accesses of one read or write region of a block whose body is `body`."""
    buffer = region.source
    if all(_is_one(r.extent) for r in region.region):
        indices = tuple(proven_index(r.min, analyzer) for r in region.region)
        return [Access(buffer, indices, GATHER if any(_loads_in(i) for i in indices) else POINT)]
    out = []
    local = _body_vars(body)
    for indices in _load_indices(body, buffer):
        if any(vars_in(i) & local for i in indices):
            out = []  # a load inside a loop or binding of the body: per iteration, not per element
            break
        simple = tuple(proven_index(i, analyzer) for i in indices)
        if not any(tvm_ffi.structural_equal(simple, a.indices) for a in out):
            out.append(Access(buffer, simple, GATHER))
    return out or [Access(buffer, tuple(r.min for r in region.region), REGION)]


def _body_vars(stmt) -> set:
    """The variables a statement defines itself: loop variables and let bindings."""
    found = set()
    tvm_ffi.structural_walk(stmt, ((tirx.For, lambda loop: found.add(loop.loop_var)),
                                   ((tirx.Let, tirx.LetStmt, tirx.Bind), lambda let: found.add(let.var))), order="post")
    return found


def _loads_in(expr) -> bool:
    """Whether an expression loads from a buffer."""
    if isinstance(expr, _LEAVES):
        return False
    found = []
    tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, found.append), order="post")
    return bool(found)


def _load_indices(stmt, buffer) -> list:
    """The index tuples of every load of `buffer` in `stmt`."""
    found = []

    def on_load(load):
        if load.source.same_as(buffer):
            found.append(tuple(load.indices))

    tvm_ffi.structural_walk(stmt, (tvm.ir.TensorLoad, on_load), order="post")
    return found


def proven_index(expr, analyzer):
    """An access index, simplified, with `(q * n + r) // n` -> q and `(q * n + r) % n` -> r where
    0 <= r < n is proven: the simplifier keeps those for a symbolic n (a reshape's index over a
    symbolic sequence length)."""
    simple = analyzer.simplify(expr)
    if not any(not isinstance(n, tirx.IntImm) for n in _divisors(simple)):
        return simple

    def on_div(node):
        parts = _quotient(node.a, node.b, analyzer)
        return node if parts is None else parts[0]

    def on_mod(node):
        parts = _quotient(node.a, node.b, analyzer)
        return node if parts is None else parts[1]

    return analyzer.simplify(tvm_ffi.structural_map(simple, ((tirx.FloorDiv, on_div), (tirx.FloorMod, on_mod))))


def _divisors(expr) -> list:
    if isinstance(expr, _LEAVES):
        return []
    found = []
    tvm_ffi.structural_walk(expr, ((tirx.FloorDiv, tirx.FloorMod), lambda node: found.append(node.b)), order="post")
    return found


def divides_by_symbolic(func: tirx.PrimFunc) -> bool:
    """Whether an index of `func` is divided (or taken modulo) by a symbolic size: a reshape over
    a symbolic sequence length computes it per element."""
    return any(not isinstance(n, tirx.IntImm) for n in _divisors(func.body))


def _quotient(value, divisor, analyzer):
    """(q, r) with value == q * divisor + r and 0 <= r < divisor proven, for a symbolic divisor; else None."""
    if isinstance(divisor, tirx.IntImm):
        return None
    terms, stack = [], [value]
    while stack:
        term = stack.pop()
        if isinstance(term, tirx.Add):
            stack.extend([term.a, term.b])
        else:
            terms.append(term)
    zero = tirx.const(0, str(value.ty))
    quotient, rest = zero, zero
    for term in terms:
        if isinstance(term, tirx.Mul) and tvm_ffi.structural_equal(term.b, divisor):
            quotient = quotient + term.a
        elif isinstance(term, tirx.Mul) and tvm_ffi.structural_equal(term.a, divisor):
            quotient = quotient + term.b
        else:
            rest = rest + term
    if not (analyzer.can_prove(rest >= 0) and analyzer.can_prove(rest < divisor)):
        return None
    return analyzer.simplify(quotient), analyzer.simplify(rest)


def static_int(expr) -> int | None:
    """The value of an integer constant, None for anything symbolic."""
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def static_product(exprs) -> int | None:
    """The product of integer constants (a shape's element count); None if any is symbolic."""
    total = 1
    for expr in exprs:
        value = static_int(expr)
        if value is None:
            return None
        total *= value
    return total


def buffer_params(func: tirx.PrimFunc) -> list:
    """The buffer parameters of a PrimFunc, in order (scalar ones, e.g. symbolic sizes, left out)."""
    return [p for p in func.params if isinstance(p.ty, tirx.BufferType)]


def _is_one(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value == 1


def vars_in(expr) -> set:
    """The tirx.Var objects an expression uses (including inside loads)."""
    if isinstance(expr, _LEAVES):
        return {expr} if isinstance(expr, tirx.Var) else set()
    found = set()
    tvm_ffi.structural_walk(expr, (tirx.Var, found.add), order="post")
    return found


def substitute(expr, mapping: dict):
    """`expr` with each tirx.Var that `mapping` holds replaced by its value there."""
    return tvm_ffi.structural_mutate(expr, [(tirx.Var, lambda v, _m: mapping.get(v, v))])


ARITHMETIC_BUDGET = 12  # operations per element beyond which a block counts as expensive


def expensive_ops(stmt) -> tuple:
    """Names of expensive intrinsics and float divisions in a statement.

    A body with more than ARITHMETIC_BUDGET operations (an inline polynomial
    such as fast_exp) is listed as "arithmetic": recomputing it per use costs
    as much as a transcendental.
    """
    names = []
    operations = [0]

    def on_call(call):
        operations[0] += 1
        op = getattr(call, "op", None)
        if isinstance(op, tvm.ir.Op):
            short = op.name.split(".")[-1]
            if short in EXPENSIVE_INTRINSICS:
                names.append(short)

    def on_div(div):
        operations[0] += 1
        if "float" in str(div.ty) or "bfloat" in str(div.ty):
            names.append("divide")

    def on_arithmetic(_node):
        operations[0] += 1

    arithmetic = (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Max, tirx.Min,
                  tirx.Select, tirx.Cast)
    tvm_ffi.structural_walk(stmt, ((tvm.ir.Call, on_call), (tirx.Div, on_div), (arithmetic, on_arithmetic)),
                            order="post")
    if operations[0] > ARITHMETIC_BUDGET:
        names.append("arithmetic")
    return tuple(sorted(names))


def _trivial_binding(sch: s_tir.Schedule, block_rv, block) -> bool:
    """Each block iterator has its own loop, in order, from zero.

    Unit iterators bound to the constant 0 (scalar blocks) need no loop.
    """
    loops = tuple(sch.get(loop) for loop in sch.get_loops(block_rv))
    realize = loops[-1].body if loops else None
    if loops and not isinstance(realize, s_tir.SBlockRealize):
        return False
    return _bound_to_loops(loops, realize, block)


def _load_counts(stmt) -> tuple:
    counts = []

    def on_load(load):
        for i, (buf, n) in enumerate(counts):
            if buf.same_as(load.source):
                counts[i] = (buf, n + 1)
                return
        counts.append((load.source, 1))

    tvm_ffi.structural_walk(stmt, (tvm.ir.TensorLoad, on_load), order="post")
    return tuple(counts)


def view_of_block(block, trivial_binding: bool = True) -> BlockView:
    """The view of one block (its loops are not looked at: `trivial_binding` says what they are)."""
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        # Unit iterators stay variables: simplified to 0 they would no longer
        # show which axis of the access they index.
        if not _is_one(iv.dom.extent):
            analyzer.bind(iv.var, iv.dom)
    return BlockView(
        name=block.name_hint,
        iter_vars=tuple(iv.var for iv in block.iter_vars),
        extents=tuple(iv.dom.extent for iv in block.iter_vars),
        is_reduce=tuple(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars),
        reads=tuple(a for r in block.reads for a in _accesses(r, block.body, analyzer)),
        writes=tuple(a for w in block.writes for a in _accesses(w, tirx.Evaluate(0), analyzer)),
        expensive=expensive_ops(block.body),
        trivial_binding=trivial_binding,
        loads=_load_counts(block.body),
    )


def block_views(sch: s_tir.Schedule) -> list:
    """Views of the top-level blocks of the schedule's function, in order."""
    nested = _top_blocks(sch.mod["main"])
    if nested is not None:
        return _views_of(nested)
    return [
        view_of_block(sch.get(block_rv), _trivial_binding(sch, block_rv, sch.get(block_rv)))
        for block_rv in sch.get_child_blocks(get_root_block(sch))
    ]


def function_views(func: tirx.PrimFunc) -> list:
    """`block_views` of a schedule of `func` (whose function is `func` itself), read off `func`
    without making the schedule where the loops allow."""
    nested = _top_blocks(func)
    return _views_of(nested) if nested is not None else block_views(s_tir.Schedule(func))


def _views_of(nested: list) -> list:
    return [view_of_block(realize.block, _bound_to_loops(loops, realize, realize.block)) for loops, realize in nested]


def _top_blocks(func: tirx.PrimFunc) -> list | None:
    """(enclosing loops, realize) of each child block of the root block, in order, read off the
    function (what `get_child_blocks` and `get_loops` of a schedule give); None where a statement
    other than a loop or a sequence lies between the root block and a child block."""
    if not isinstance(func.body, s_tir.SBlockRealize):
        return None
    out = []

    def walk(stmt, loops: tuple) -> bool:
        if isinstance(stmt, s_tir.SBlockRealize):
            out.append((loops, stmt))
            return True
        if isinstance(stmt, tirx.For):
            return walk(stmt.body, loops + (stmt,))
        if isinstance(stmt, tirx.SeqStmt):
            return all(walk(s, loops) for s in stmt.seq)
        return False

    return out if walk(func.body.block.body, ()) else None


def _bound_to_loops(loops: tuple, realize, block) -> bool:
    """`_trivial_binding` of `block`, realized by `realize` within `loops` (outermost first)."""
    if not loops:
        return all(_is_one(iv.dom.extent) for iv in block.iter_vars)
    if not loops[-1].body.same_as(realize):
        return False
    bound = [(v, iv) for v, iv in zip(realize.iter_values, block.iter_vars)
             if not (isinstance(v, tirx.IntImm) and _is_one(iv.dom.extent))]
    return len(bound) == len(loops) and all(
        isinstance(value, tirx.Var)
        and value.same_as(loop.loop_var)
        and isinstance(loop.min, tirx.IntImm)
        and loop.min.value == 0
        and tvm_ffi.structural_equal(loop.extent, iv.dom.extent)
        for (value, iv), loop in zip(bound, loops)
    )


def all_block_views(func: tirx.PrimFunc) -> list:
    """Views of every block of a function, scheduled or not (loop structure not examined)."""
    views = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: views.append(view_of_block(b))
                                        if b.name_hint != "root" else None), order="pre")
    return views


def block_consumers(views: list) -> dict:
    """Name of each block -> names of the other blocks that read what it writes."""
    out = {view.name: set() for view in views}
    for view in views:
        for read in view.reads:
            for producer in views:
                if producer.name != view.name and any(w.buffer.same_as(read.buffer) for w in producer.writes):
                    out[producer.name].add(view.name)
    return out
