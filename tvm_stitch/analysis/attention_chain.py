"""Attention chains in a Relax function, as they arrive from transformers' eager attention.

A chain is, per (batch, head):

    scores = matmul(Q, permute_dims(K))            (optionally through a 3-d batched matmul:
                                                    broadcast_to / reshape views of 4-d tensors)
    logits = scores * c | scores / c | scores       (c a scalar constant)
             (+ mask)                               (an additive mask, broadcast to the scores)
    P      = softmax(logits, axis=-1)               (astype around it allowed)
    O      = matmul(P, V)                           (reshaped back to 4-d where it was 3-d)

K and V may be repeated KV heads (grouped-query attention: `expand_dims`,
`broadcast_to`, `reshape` of a (batch, kv_heads, len, dim) tensor), and the
query length may differ from the key length (cross-attention). Every
intermediate of the chain must be read by the chain alone: a score or
probability tensor read elsewhere (returned attention weights) keeps the
chain unfused. Q, K and V are read through the views that make them from
another tensor (split, strided slice, reshape, permute: GPT-2's head split
of `c_attn`'s output), and through a rotary embedding applied to them
(LLaMA's `x * cos + rotate_half(x) * sin`, its cos and sin tables read per
position), recorded as an OperandView each (analysis/attention_operand.py),
so that these launch nothing. TVM's attention op (`R.nn.attention`,
`R.nn.attention_bias`, as torch's scaled_dot_product_attention is imported:
between permutes to and from (batch, len, heads, dim)) is a chain too.
Dimensions are ints or, for a symbolic batch or length, expressions
compared by proof (analysis/shape_dims.py). `find_chains` returns what it found as plain
data, and for every softmax that looks like the middle of a chain but is
not one, the reason (a code of planning/reasons.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_stitch.analysis.attention_operand import OperandView, reshape_groups
from tvm_stitch.analysis.shape_dims import dims, is_static, product, same, static

VIEW_OPS = ("relax.reshape", "relax.broadcast_to")
MASKED = -1.0e4  # an additive mask value at or below this hides the key (exp underflows in float32)


@dataclass(frozen=True)
class AttentionChain:
    """One chain: the Relax expressions the fused kernel reads and the binding it replaces."""

    output: relax.Var  # the binding whose value the kernel's result replaces
    q: relax.Expr  # (batch, heads, q_len, head_dim)
    k: relax.Expr  # (batch, kv_heads, kv_len, head_dim)
    v: relax.Expr
    mask: relax.Expr | None  # an additive mask read by the kernel (None: no mask, or causal)
    mask_kind: str  # "none", "causal" or "additive"
    scale: float
    bindings: tuple  # names of the chain's bindings (the report's)
    sources: tuple = ()  # the tensors the kernel reads Q, K, V from (views of them absorbed)
    views: tuple = ()  # an OperandView per source: how Q, K, V are read from it
    tables: tuple = ()  # the rotary embeddings' cos and sin tables, in order (Q's, K's, V's where present)


@dataclass(frozen=True)
class NotAChain:
    """A softmax that is not the middle of a fusable chain: where, and why (a reason code)."""

    binding: str
    code: str
    params: dict


def _shape(expr) -> tuple | None:
    """Its dimensions: ints, and simplified expressions where symbolic (analysis/shape_dims.py)."""
    return dims(expr)


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


class _Graph:
    """The bindings of a function's dataflow blocks: var -> value, and how often each var is read."""

    def __init__(self, func: relax.Function):
        self.value, self.uses, self.order = {}, {}, []
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.value[binding.var] = binding.value
                    self.order.append(binding.var)
                for var in relax.analysis.free_vars(binding.value):
                    self.uses[var] = self.uses.get(var, 0) + 1
        for var in relax.analysis.free_vars(func.body.body):
            self.uses[var] = self.uses.get(var, 0) + 1
        self.readers = {}
        for var in self.order:
            for used in relax.analysis.free_vars(self.value[var]):
                self.readers.setdefault(used, []).append(var)

    def call(self, expr, *ops):
        """The call `expr` is bound to, if it is a call of one of `ops`."""
        value = self.value.get(expr) if isinstance(expr, relax.Var) else None
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in ops:
            return value
        return None

    def single_reader(self, var):
        readers = self.readers.get(var, [])
        return readers[0] if len(readers) == 1 and self.uses.get(var, 0) == 1 else None


def _through_views(graph: _Graph, expr):
    """`expr` with the views before it that keep its elements in order removed: broadcast_to its own
    shape, reshapes that merge or split leading axes only (the last two axes kept)."""
    while True:
        call = graph.call(expr, *VIEW_OPS)
        if call is None:
            return expr
        inner, outer = _shape(call.args[0]), _shape(expr)
        if inner is None or outer is None or not 2 <= len(inner) <= 4 or len(outer) < 2:
            return expr  # a 5-d input: the repeat of grouped-query attention (see _kv_heads)
        if call.op.name == "relax.broadcast_to" and not same(inner, outer):
            return expr
        if not same(inner[-2:], outer[-2:]) or not same(product(inner), product(outer)):
            return expr
        expr = call.args[0]


def _kv_heads(graph: _Graph, expr):
    """(the KV tensor, group) where `expr` repeats each KV head `group` times, else (expr, 1)."""
    reshape = graph.call(expr, "relax.reshape")
    bcast = graph.call(reshape.args[0], "relax.broadcast_to") if reshape is not None else None
    expand = graph.call(bcast.args[0], "relax.expand_dims") if bcast is not None else None
    if expand is None or [int(a) for a in expand.attrs.axis] != [2]:
        return expr, 1
    kv, repeated = _shape(expand.args[0]), _shape(bcast)
    if (kv is None or repeated is None or len(kv) != 4 or not same(repeated[:2] + repeated[3:], kv)
            or not is_static(repeated[2])):
        return expr, 1
    return expand.args[0], repeated[2]


def _scalar(expr) -> float | None:
    if isinstance(expr, tvm.ir.Constant):
        data = expr.value.numpy()
        return float(data.reshape(-1)[0]) if data.size == 1 else None
    return None


def _view_users(graph: _Graph, var, chain: list):
    """Follow `var`'s single reader through astype and views; the first other reader's call and var.
    Raises _Stop where a var of the chain has another reader."""
    while True:
        reader = graph.single_reader(var)
        if reader is None:
            raise _Stop("attention-weights-read", binding=var.name)
        chain.append(reader)
        call = graph.value[reader]
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name in VIEW_OPS + ("relax.astype",)):
            return call, reader
        var = reader


class _Stop(Exception):
    def __init__(self, code: str, **params):
        super().__init__(code)
        self.code, self.params = code, params


def _unwrap(graph: _Graph, expr, ops: tuple):
    """`expr` with single-use bindings of `ops` (views, astype) before it removed."""
    while True:
        call = graph.call(expr, *ops)
        if call is None or graph.uses.get(expr, 0) != 1:
            return expr
        expr = call.args[0]


def _scores(graph: _Graph, logits):
    """(Q operand, K^T operand, scale, mask expr or None) of the logits' producers."""
    logits = _unwrap(graph, logits, ("relax.astype",))
    mask = None
    add = graph.call(logits, "relax.add")
    if add is not None:
        for scores, other in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
            if _product(graph, scores) is not None:
                logits, mask = scores, other
                break
        else:
            raise _Stop("attention-no-scores", binding=logits.name)
    found = _product(graph, logits)
    if found is None:
        raise _Stop("attention-no-scores", binding=logits.name)
    return (*found, mask)


def _product(graph: _Graph, expr):
    """(A, B, scale) where expr = matmul(A, B) * scale (through views; scale 1.0 without one), else None."""
    scale = 1.0
    for op in ("relax.multiply", "relax.divide"):
        call = graph.call(expr, op)
        if call is None or graph.uses.get(expr, 0) != 1:
            continue
        pairs = [(call.args[0], call.args[1])] + ([(call.args[1], call.args[0])] if op == "relax.multiply" else [])
        for inner, const in pairs:
            c = _scalar(const)
            if c is not None and c != 0.0:
                expr, scale = inner, (c if op == "relax.multiply" else 1.0 / c)
                break
        else:
            return None
        break
    expr = _unwrap(graph, expr, VIEW_OPS + ("relax.astype",))  # a half matmul of float32 out_dtype, cast back
    matmul = graph.call(expr, "relax.matmul")
    if matmul is None or graph.uses.get(expr, 0) != 1:
        return None
    return matmul.args[0], matmul.args[1], scale


def _transposed(graph: _Graph, expr):
    """K where `expr` is K transposed in its last two axes (through views), else None."""
    expr = _through_views(graph, expr)
    call = graph.call(expr, "relax.permute_dims")
    shape = _shape(expr)
    if call is None or shape is None:
        return None
    rank = len(shape)
    axes = [int(a) for a in call.attrs.axes] if call.attrs.axes is not None else list(range(rank))[::-1]
    return call.args[0] if axes == list(range(rank - 2)) + [rank - 1, rank - 2] else None


def mask_kind(mask, q_len: int, kv_len: int) -> str:
    """"none" (no mask, or a constant of zeros), "causal" (a constant whose every (batch, head) slice is
    0 on and below the diagonal aligned at the end and at most MASKED above it), else "additive"."""
    if mask is None:
        return "none"
    if not isinstance(mask, tvm.ir.Constant):
        return "additive"
    data = mask.value.numpy().astype(np.float64)
    if not data.any():
        return "none"
    if not static((q_len, kv_len)):
        return "additive"
    return "causal" if is_causal(data, q_len, kv_len) else "additive"


def is_causal(data: np.ndarray, q_len: int, kv_len: int) -> bool:
    """Whether every (batch, head) slice of `data` is 0 on and below the diagonal aligned at the end
    (key j seen by query i where j <= i + kv_len - q_len) and at most MASKED above it."""
    if data.ndim < 2 or data.shape[-2:] != (q_len, kv_len):
        return False
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    seen = j <= i + (kv_len - q_len)
    rows = data.reshape(-1, q_len, kv_len)
    return not rows[:, seen].any() and bool(np.all(rows[:, ~seen] <= MASKED))


def _as_4d(shape: tuple | None) -> tuple | None:
    if shape is None or len(shape) not in (3, 4):
        return None
    return shape if len(shape) == 4 else (1,) + shape


def _chain_at(graph: _Graph, p_var) -> AttentionChain:
    softmax = graph.value[p_var]
    rank = len(_shape(p_var) or ())
    if int(softmax.attrs.axis) not in (-1, rank - 1):
        raise _Stop("attention-softmax-axis", binding=p_var.name)
    names = [p_var]
    call, reader = _view_users(graph, p_var, names)
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul"):
        raise _Stop("attention-no-second-matmul", binding=p_var.name)
    output = reader
    cast = graph.single_reader(output)  # a half matmul of float32 out_dtype, cast back to the inputs' dtype
    if cast is not None and graph.call(cast, "relax.astype") is not None and _dtype(reader) != _dtype(call.args[1]):
        output = cast
        names.append(cast)
    after = graph.single_reader(output)
    reshape = graph.call(after, "relax.reshape") if after is not None else None
    if reshape is not None and _shape(after) is not None and len(_shape(after)) == 4 and len(_shape(output)) == 3:
        output = after
        names.append(after)
    v, v_group = _kv_heads(graph, _through_views(graph, call.args[1]))
    q_arg, kt_arg, scale, mask = _scores(graph, softmax.args[0])
    k_t = _transposed(graph, kt_arg)
    if k_t is None:
        raise _Stop("attention-no-transpose", binding=p_var.name)
    k, k_group = _kv_heads(graph, k_t)
    q = _through_views(graph, q_arg)
    return _checked(graph, AttentionChain(output, q, k, v, mask, "", scale, ()), (k_group, v_group), names)


ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias")
BSHD = [0, 2, 1, 3]  # (batch, len, heads, dim) <-> (batch, heads, len, dim)


def _op_chain_at(graph: _Graph, var) -> AttentionChain:
    """TVM's attention op (`R.nn.attention`, `R.nn.attention_bias`: torch's scaled_dot_product_attention as
    imported) over (batch, len, heads, dim) permutes of (batch, heads, len, dim) tensors, its output permuted
    back: Q, K, V are the permutes' inputs, the chain's output the permute after it."""
    call = graph.value[var]
    if call.attrs.window_size is not None:
        raise _Stop("attention-window", binding=var.name)
    permutes = [graph.call(arg, "relax.permute_dims") for arg in call.args[:3]]
    reader = graph.single_reader(var)
    back = graph.call(reader, "relax.permute_dims") if reader is not None else None
    if any(p is None or p.attrs.axes is None or [int(a) for a in p.attrs.axes] != BSHD for p in permutes + [back]):
        raise _Stop("attention-layout", binding=var.name)
    q, k, v = (p.args[0] for p in permutes)
    head_dim = (_shape(q) or (0,))[-1]
    scale = float(call.attrs.scale.value) if call.attrs.scale is not None else (
        1.0 / float(np.sqrt(head_dim)) if is_static(head_dim) and head_dim > 0 else 0.0)
    mask = call.args[3] if len(call.args) > 3 else None
    chain = _checked(graph, AttentionChain(reader, q, k, v, mask, "", scale, ()), (1, 1), [var, reader])
    causal = call.attrs.causal_mask
    if causal is None:
        return chain
    if mask is not None:
        raise _Stop("attention-mask-and-causal", binding=var.name)
    q_len, kv_len = _as_4d(_shape(q))[2], _as_4d(_shape(k))[2]
    if str(causal) == "TopLeft" and not same(q_len, kv_len):  # the kernel aligns the diagonal at the end
        raise _Stop("attention-causal-alignment", binding=var.name, alignment=str(causal))
    return dataclasses.replace(chain, mask_kind="causal")


def _checked(graph: _Graph, chain: AttentionChain, groups: tuple, names: list) -> AttentionChain:
    """`chain` with its mask kind and binding names, after checking that the shapes make attention."""
    q, k, v, out = (_as_4d(_shape(e)) for e in (chain.q, chain.k, chain.v, chain.output))
    if None in (q, k, v, out):
        raise _Stop("attention-shapes", shapes=str([_shape(e) for e in (chain.q, chain.k, chain.v)]))
    dtypes = {_dtype(e) for e in (chain.q, chain.k, chain.v, chain.output)}
    if len(dtypes) != 1:
        raise _Stop("attention-dtypes", dtypes=", ".join(sorted(dtypes)))
    if not static((q[1], k[1], q[3], k[3])):
        raise _Stop("attention-symbolic-dims", shapes=str([q, k, v]))
    if (groups[0] != groups[1] or not same(k, v) or not same(q[0], k[0]) or q[1] != k[1] * groups[0]
            or q[3] != k[3] or not same(out, q)):
        raise _Stop("attention-shapes", shapes=str([q, k, v]))
    kind = mask_kind(chain.mask, q[2], k[2])
    if kind == "additive":
        mask = _shape(chain.mask)
        if mask is None or len(mask) > 4 or any(not (same(m, 1) or same(m, t)) for m, t in
                                                zip(((1,) * (4 - len(mask)) + mask), (q[0], q[1], q[2], k[2]))):
            raise _Stop("attention-mask-shape", shape=str(mask))
        if not same(mask[-1], k[2]):
            raise _Stop("attention-mask-shape", shape=str(mask))
    read = [operand_view(graph, e) for e in (chain.q, chain.k, chain.v)]
    return AttentionChain(chain.output, chain.q, chain.k, chain.v, chain.mask if kind == "additive" else None,
                          kind, chain.scale, tuple(v.name for v in names), tuple(r[0] for r in read),
                          tuple(r[1] for r in read), tuple(t for r in read for t in r[2]))


def operand_view(graph: _Graph, expr) -> tuple:
    """(source, OperandView, rotary tables): `expr` (a 3- or 4-d operand) as the views of `source` that
    make it, after a rotary embedding where `expr` is one (its cos and sin tables, else ())."""
    shape = _shape(expr)
    four = _as_4d(shape)
    steps = [] if len(shape) == 4 else [("reshape", shape, four)]
    rotary = _rotary(graph, expr) if len(shape) == 4 else None
    tables = ()
    if rotary is not None:
        expr, tables = rotary[0], rotary[1:]
    while True:
        found = _view_step(graph, expr)
        if found is None:
            view = OperandView(_shape(expr), tuple(steps))
            if tables:
                view = dataclasses.replace(view, cos=_shape(tables[0]), sin=_shape(tables[1]),
                                           table_dtype=_dtype(tables[0]))
            return expr, view, tables
        expr, step = found
        steps[:0] = [step] if step is not None else []


def _rotary(graph: _Graph, expr):
    """(x, cos, sin) where `expr` = x * cos + concat(-x[..., half:], x[..., :half]) * sin (a rotary
    embedding, LLaMA's `apply_rotary_pos_emb`) with tables broadcast over batch and heads, else None."""
    add = graph.call(expr, "relax.add")
    if add is None:
        return None
    for first, second in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
        plain, rotated = graph.call(first, "relax.multiply"), graph.call(second, "relax.multiply")
        if plain is None or rotated is None:
            continue
        for x, cos in ((plain.args[0], plain.args[1]), (plain.args[1], plain.args[0])):
            for rot, sin in ((rotated.args[0], rotated.args[1]), (rotated.args[1], rotated.args[0])):
                if _rotated_half(graph, rot, x) and _table(cos, _shape(expr)) and _table(sin, _shape(expr)):
                    return x, _unpadded(graph, cos), _unpadded(graph, sin)
    return None


def _rotated_half(graph: _Graph, rot, x) -> bool:
    """Whether `rot` = concat(-x[..., half:], x[..., :half], axis=-1) (static slices of a 4-d x)."""
    concat = graph.call(rot, "relax.concat")
    shape = _shape(x)
    if concat is None or shape is None or len(shape) != 4 or int(concat.attrs.axis) not in (-1, 3):
        return False
    parts = list(concat.args[0].fields) if isinstance(concat.args[0], relax.Tuple) else []
    if len(parts) != 2 or not is_static(shape[3]) or shape[3] % 2:
        return False
    neg = graph.call(parts[0], "relax.negative")
    high, low = (_view_step(graph, p) for p in (neg.args[0] if neg is not None else None, parts[1]))
    half = shape[3] // 2
    return (high is not None and low is not None and high[0].same_as(x) and low[0].same_as(x)
            and high[1][0] == low[1][0] == "slice" and same(high[1][1], shape) and same(low[1][1], shape)
            and high[1][2] == (3, half, 1) and low[1][2] == (3, 0, 1)
            and same(_shape(parts[0]), shape[:3] + (half,)) and same(_shape(parts[1]), shape[:3] + (half,)))


def _unpadded(graph: _Graph, expr):
    """`expr` without the expand_dims or reshapes before it that only add leading axes of extent 1."""
    while True:
        call = graph.call(expr, "relax.expand_dims", "relax.reshape")
        inner = _shape(call.args[0]) if call is not None else None
        if inner is None or not inner or not same((1,) * (len(_shape(expr)) - len(inner)) + inner, _shape(expr)):
            return expr
        expr = call.args[0]


def _table(expr, shape: tuple) -> bool:
    """Whether `expr` is a cos or sin table of `shape`'s (positions, dim), broadcast over batch and heads."""
    table = _shape(expr)
    table = (1,) * (4 - len(table)) + table if table is not None and 2 <= len(table) <= 4 else None
    return (table is not None and same(table[2:], shape[2:]) and same(table[1], 1)
            and (same(table[0], 1) or same(table[0], shape[0])) and _dtype(expr) in ("float32", "float16", "bfloat16"))


def _view_step(graph: _Graph, expr):
    """(the tensor `expr` is a view of, the view step) where `expr` is a static view, else None."""
    value = graph.value.get(expr) if isinstance(expr, relax.Var) else None
    if isinstance(value, relax.TupleGetItem):
        split = graph.call(value.tuple_value, "relax.split")
        inner = _shape(split.args[0]) if split is not None else None
        if inner is None:
            return None
        axis = int(split.attrs.axis) % len(inner)
        cuts = split.attrs.indices_or_sections
        if not is_static(inner[axis]):
            return None
        begin = (value.index * (inner[axis] // int(cuts)) if isinstance(cuts, tirx.IntImm)
                 else ([0] + [int(c) for c in cuts])[value.index])
        return split.args[0], ("slice", inner, (axis, begin, 1))
    call = graph.call(expr, "relax.permute_dims", "relax.reshape", "relax.strided_slice", "relax.broadcast_to")
    inner = _shape(call.args[0]) if call is not None else None
    if inner is None or _shape(expr) is None:
        return None
    name = call.op.name
    if name == "relax.permute_dims":
        axes = [int(a) for a in call.attrs.axes] if call.attrs.axes is not None else list(range(len(inner)))[::-1]
        return call.args[0], ("permute", inner, tuple(axes))
    if name == "relax.reshape":
        return (call.args[0], ("reshape", inner, _shape(expr))) if reshape_groups(_shape(expr), inner) else None
    if name == "relax.broadcast_to":
        return (call.args[0], None) if same(inner, _shape(expr)) else None
    return _sliced(call, inner)


def _sliced(call, inner: tuple):
    """(input, slice step) of a strided_slice of one axis with static bounds, else None."""
    try:
        axes, begin, _, *strides = ([int(v.value) for v in arg.fields] for arg in call.args[1:5])
    except (AttributeError, TypeError, ValueError):
        return None
    strides = strides[0] if strides else [1]
    if len(axes) != 1 or len(strides) != 1 or strides[0] <= 0 or begin[0] < 0:
        return None
    return call.args[0], ("slice", inner, (axes[0] % len(inner), begin[0], strides[0]))


def find_chains(func: relax.Function) -> tuple:
    """([AttentionChain], [NotAChain]) of `func`: each softmax that ends a chain's scores, or why not."""
    if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
        return [], []
    graph = _Graph(func)
    chains, others = [], []
    for var in graph.order:
        found = _op_chain_at if graph.call(var, *ATTENTION_OPS) is not None else _chain_at
        if found is _chain_at and graph.call(var, "relax.nn.softmax") is None:
            continue
        try:
            chains.append(found(graph, var))
        except _Stop as stop:
            others.append(NotAChain(var.name, stop.code, dict(stop.params)))
    return chains, others
