"""The block views read off a PrimFunc are those read through a schedule's lookups."""

import pytest
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block

from tvm_stitch.analysis.tir_view import _trivial_binding, block_views, function_views, view_of_block

from conftest import legalized, make_module, tensor

N = tirx.Var("n", "int64")


def _through_lookups(sch: s_tir.Schedule) -> list:
    """The views as schedule lookups give them (get_child_blocks, get_loops, get)."""
    return [view_of_block(sch.get(rv), _trivial_binding(sch, rv, sch.get(rv)))
            for rv in sch.get_child_blocks(get_root_block(sch))]


def _same(a, b) -> bool:
    return (a.name == b.name and a.trivial_binding == b.trivial_binding and a.is_reduce == b.is_reduce
            and a.expensive == b.expensive and tvm_ffi.structural_equal(a.extents, b.extents)
            and all(x.kind == y.kind and x.buffer.same_as(y.buffer) and tvm_ffi.structural_equal(x.indices, y.indices)
                    for x, y in zip(a.reads + a.writes, b.reads + b.writes))
            and len(a.reads) == len(b.reads) and len(a.writes) == len(b.writes)
            and [(buf.name, n) for buf, n in a.loads] == [(buf.name, n) for buf, n in b.loads])


def _prim_funcs(shape, op):
    mod = legalized(make_module([tensor("x", shape)], lambda bb, x: op(x)))
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize("shape, op", [
    ((64, 32), lambda x: relax.op.nn.softmax(x, axis=-1)),
    ([N, 768], lambda x: relax.op.nn.softmax(x, axis=-1)),
    ((8, 16, 4), lambda x: relax.op.sum(x)),  # a scalar output block
    ((4, 6), lambda x: relax.op.exp(relax.op.permute_dims(x))),
], ids=["softmax", "symbolic-rows", "scalar", "transposed"])
def test_views_off_the_function_are_the_schedules(shape, op):
    for func in _prim_funcs(shape, op):
        sch = s_tir.Schedule(func)
        reference = _through_lookups(sch)
        assert reference
        for views in (function_views(func), block_views(sch)):
            assert len(views) == len(reference) and all(_same(a, b) for a, b in zip(views, reference))


def test_loops_that_do_not_bind_the_iterators_one_each_are_not_trivial():
    (func,) = _prim_funcs((64, 32), lambda x: relax.op.exp(x))
    sch = s_tir.Schedule(func)
    block = sch.get_child_blocks(get_root_block(sch))[0]
    outer, _ = sch.get_loops(block)
    sch.split(outer, [8, 8])
    reference = _through_lookups(sch)
    assert [v.trivial_binding for v in reference] == [False]
    assert [v.trivial_binding for v in block_views(sch)] == [False]
    assert [v.trivial_binding for v in function_views(sch.mod["main"])] == [False]
