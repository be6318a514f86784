"""Closed forms of index maps and gathers (closed_form.py's module docstring): `broadcast_to`, `expand_dims`,
`squeeze`, `reshape`, `permute_dims`, `strided_slice`, `concat`, `take`, `index_tensor`, and the `cumsum` of
a summand constant along its axis."""

from __future__ import annotations

from types import MappingProxyType

from tvm import tirx

from tvm_stitch.analysis.closed_form import NotClosed, as_int64, axis_index, in_bounds, is_integer, make, mapped, need
from tvm_stitch.analysis.tir_view import static_int


def _broadcast_to(call, forms, facts, shape, dtype):
    x = mapped(need(call.args[0], forms), shape, facts)
    return make(shape, dtype, facts, x)


def _expand_dims(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    added = {axis_index(a, len(shape)) for a in call.attrs.axis}
    kept = [k for k in range(len(shape)) if k not in added]
    return make(shape, dtype, facts, lambda idx: x.at([idx[k] for k in kept]))


def _squeeze(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    rank = len(x.shape)
    if call.attrs.axis is None:
        dropped = {k for k, d in enumerate(x.shape) if static_int(d) == 1}
    else:
        dropped = {axis_index(a, rank) for a in call.attrs.axis}
    zero = tirx.IntImm("int64", 0)

    def element(idx):
        rest = iter(idx)
        return x.at([zero if k in dropped else next(rest) for k in range(rank)])

    return make(shape, dtype, facts, element)


def _reshape(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)

    def element(idx):
        flat = tirx.IntImm("int64", 0)
        for index, extent in zip(idx, shape):
            flat = flat * extent + index
        inner, source = tirx.IntImm("int64", 1), []
        for extent in reversed(x.shape):
            quotient = flat if facts.proves(inner == 1) else tirx.floordiv(flat, inner)
            source.append(quotient if facts.proves(quotient < extent) else tirx.floormod(quotient, extent))
            inner = inner * extent
        return x.at(source[::-1])

    return make(shape, dtype, facts, element)


def _permute_dims(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    rank = len(x.shape)
    axes = list(range(rank))[::-1] if call.attrs.axes is None else [axis_index(a, rank) for a in call.attrs.axes]

    def element(idx):
        source = [None] * rank
        for k, a in enumerate(axes):
            source[a] = idx[k]
        return x.at(source)

    return make(shape, dtype, facts, element)


def _strided_slice(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    axes, begins = list(call.args[1].fields), list(call.args[2].fields)
    strides = list(call.args[4].fields) if len(call.args) > 4 and len(call.args[4].fields) else \
        [tirx.IntImm("int64", 1)] * len(axes)
    if not len(axes) == len(begins) == len(strides):
        raise NotClosed
    starts = {}
    for axis, begin, stride in zip(axes, begins, strides):
        axis = axis_index(axis.value if isinstance(axis, tirx.IntImm) else axis, len(x.shape))
        if not isinstance(stride, tirx.IntImm) or stride.value <= 0:
            raise NotClosed
        if isinstance(begin, tirx.IntImm) and begin.value < 0:
            begin = begin + x.shape[axis]
        with facts.over((), ()):
            if not facts.proves(tirx.all(begin >= 0, begin <= x.shape[axis])):
                raise NotClosed
        starts[axis] = (as_int64(begin), stride)

    def element(idx):
        return x.at([starts[k][0] + idx[k] * starts[k][1] if k in starts else idx[k] for k in range(len(idx))])

    return make(shape, dtype, facts, element)


def _concat(call, forms, facts, shape, dtype):
    parts = [need(f, forms) for f in call.args[0].fields]
    axis = axis_index(call.attrs.axis, len(shape))

    def element(idx):
        offsets, end = [], tirx.IntImm("int64", 0)
        for part in parts:
            offsets.append(end)
            end = end + part.shape[axis]
        value = None
        for part, offset in reversed(list(zip(parts, offsets))):
            here = part.at([index - offset if k == axis else index for k, index in enumerate(idx)])
            value = here if value is None else tirx.Select(idx[axis] < offset + part.shape[axis], here, value)
        return value

    return make(shape, dtype, facts, element)


def _take(call, forms, facts, shape, dtype):
    data, indices = (need(arg, forms) for arg in call.args)
    if call.attrs.axis is None:
        raise NotClosed
    axis = axis_index(call.attrs.axis, len(data.shape))
    width = len(indices.shape)

    def element(idx):
        position = as_int64(indices.at(idx[axis:axis + width]))
        in_bounds(facts, position, data.shape[axis])
        return data.at(list(idx[:axis]) + [position] + list(idx[axis + width:]))

    return make(shape, dtype, facts, element)


def _index_tensor(call, forms, facts, shape, dtype):
    data = need(call.args[0], forms)
    indices = [need(f, forms) for f in call.args[1].fields]
    lead = len(shape) - (len(data.shape) - len(indices))
    maps = [mapped(i, shape[:lead], facts) for i in indices]

    def element(idx):
        positions = [as_int64(m(idx[:lead])) for m in maps]
        for position, extent in zip(positions, data.shape):
            in_bounds(facts, position, extent)
        return data.at(positions + list(idx[lead:]))

    return make(shape, dtype, facts, element)


def _cumsum(call, forms, facts, shape, dtype):
    x = need(call.args[0], forms)
    if call.attrs.axis is None or not is_integer(x.dtype) or not is_integer(dtype) or dtype == "bool":
        raise NotClosed  # a float sum's rounding depends on its order
    axis = axis_index(call.attrs.axis, len(shape))
    zero = tirx.IntImm("int64", 0)

    def element(idx):
        summand = tirx.Cast(dtype, x.at(idx))
        first = tirx.Cast(dtype, x.at([zero if k == axis else index for k, index in enumerate(idx)]))
        if not facts.equal(summand, first):
            raise NotClosed
        count = idx[axis] if bool(call.attrs.exclusive) else idx[axis] + 1
        return first * tirx.Cast(dtype, count)

    return make(shape, dtype, facts, element)


INDEXING_RULES = MappingProxyType({
    "relax.broadcast_to": _broadcast_to,
    "relax.expand_dims": _expand_dims,
    "relax.squeeze": _squeeze,
    "relax.reshape": _reshape,
    "relax.permute_dims": _permute_dims,
    "relax.strided_slice": _strided_slice,
    "relax.concat": _concat,
    "relax.take": _take,
    "relax.index_tensor": _index_tensor,
    "relax.cumsum": _cumsum,
})
