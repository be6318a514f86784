"""Values of symbolic sizes alone in closed form (analysis/closed_form, rewrites/closed_forms)."""


import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_stitch import pipeline
from tvm_stitch.analysis.closed_form import Facts
from tvm_stitch.analysis.closed_form_rules import derive
from tvm_stitch.rewrites.closed_forms import ComputeClosedForms, closed_forms
from tvm_stitch.rewrites.host_constants import FoldHostConstants
from tvm_stitch.target import default_pipeline, host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.launches import count_launches

op = relax.op
LLVM = host_target()
CUDA = {"kind": "cuda", "arch": "sm_90"}
I64 = "int64"


def _module(body, bounds=(1, 64), extra=(), shape=lambda s: (2, s)):
    """main(x: float32 of `shape(s)`) -> x + float32(body(bb, s)); `bounds` the size's, None: unbounded."""
    s = tirx.Var("s", I64)
    x = relax.Var("x", relax.TensorType(shape(s), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            value = _emit(bb, op.astype(body(bb, s), "float32"))
            out = bb.emit_output(op.add(x, value))
        bb.emit_func_output(out)
    mod = bb.get()
    if bounds is not None:
        mod["main"] = mod["main"].with_attrs({"tir_var_lower_bound": {"s": bounds[0]},
                                              "tir_var_upper_bound": {"s": bounds[1]}})
    return mod


def _emit(bb, expr):
    """`expr` bound one call per binding (the normal form the importer gives)."""
    if isinstance(expr, relax.Call):
        args = [relax.Tuple([_emit(bb, f) for f in a.fields]) if isinstance(a, relax.Tuple) else _emit(bb, a)
                for a in expr.args]
        return bb.emit(relax.Call(expr.op, args, expr.attrs, expr.ty_args))
    return expr


def _packed_mask(bb, s):
    """transformers' packed-sequence check and causal mask for positions arange(s), as exported."""
    pos = _emit(bb, op.broadcast_to(op.expand_dims(op.arange(0, s, 1, I64), [0]), relax.ShapeExpr([2, s])))
    first = _emit(bb, op.subtract(op.strided_slice(pos, [1], [0], [1], assume_inbound=True), relax.const(1, I64)))
    cat = _emit(bb, op.concat([first, pos], axis=-1))
    diff = _emit(bb, op.subtract(op.strided_slice(cat, [1], [1], [1 + s], assume_inbound=True),
                               op.strided_slice(cat, [1], [0], [s], assume_inbound=True)))
    packed = _emit(bb, op.cumsum(op.not_equal(diff, relax.const(1, I64)), axis=-1, dtype=I64))
    batch = _emit(bb, op.reshape(op.arange(0, 2, 1, I64), [2, 1, 1]))
    q = _emit(bb, op.reshape(op.arange(0, s, 1, I64), [1, s, 1]))
    kv = _emit(bb, op.reshape(op.arange(0, s, 1, I64), [1, 1, s]))
    same = _emit(bb, op.equal(op.index_tensor(packed, [batch, q]), op.index_tensor(packed, [batch, kv])))
    causal = _emit(bb, op.less_equal(op.index_tensor(pos, [batch, kv]), op.index_tensor(pos, [batch, q])))
    allowed = _emit(bb, op.logical_and(causal, same))
    return _emit(bb, op.where(allowed, relax.const(0.0, "float32"), relax.const(-1e9, "float32")))


def _run(executable, x):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _check_against_default(mod, sizes, shape=lambda s: (2, s)):
    """The stitch pipeline's llvm build equals TVM's default build at each size."""
    ours = tvm.compile(mod, target=LLVM, relax_pipeline=pipeline(LLVM))
    theirs = tvm.compile(mod, target=LLVM, relax_pipeline=default_pipeline(LLVM))
    rng = np.random.default_rng(0)
    for size in sizes:
        x = rng.standard_normal(shape(size)).astype("float32")
        np.testing.assert_array_equal(_run(ours, x), _run(theirs, x))


def test_packed_sequence_mask_is_a_select_of_indices_and_its_cumsum_is_gone():
    mod = _module(_packed_mask, shape=lambda s: (2, s, s))
    forms = closed_forms(mod["main"])
    mask = forms[list(forms)[-1]]
    assert mask.cheap and mask.sizes_free()
    assert "cumsum" not in str(mask.element) and "Select" in str(mask.element)
    out = ComputeClosedForms()(mod)
    script = out["main"].script()
    assert "cumsum" not in script and "index_tensor" not in script and "closed_form" in script
    _check_against_default(mod, (1, 2, 7, 33), shape=lambda s: (2, s, s))


def test_the_mask_joins_the_softmax_reading_it_on_cuda():
    def masked_softmax(bb, s):
        return _emit(bb, op.nn.softmax(op.add(op.zeros((2, s, s), "float32"), _packed_mask(bb, s))))

    mod = _module(masked_softmax, shape=lambda s: (2, s, s))
    stitched, default = (build(mod, CUDA, stitched=flag) for flag in (True, False))
    assert "cumsum" not in stitched.lowered.script() and "cumsum" in default.lowered.script()
    assert count_launches(stitched.lowered, stitched.executable) == 1
    assert count_launches(default.lowered, default.executable) >= 6  # the scan alone is 4
    _check_against_default(mod, (1, 5, 40), shape=lambda s: (2, s, s))


def _rotary(start=lambda s: 0, stop=lambda s: None):
    def body(bb, s):
        positions = _emit(bb, op.astype(op.arange(start(s), stop(s) if stop(s) is not None else s, 1, I64),
                                        "float32"))
        freq = relax.const(1.0 / 10000 ** (np.arange(8, dtype="float32") / 8))
        angles = _emit(bb, op.multiply(op.expand_dims(positions, [1]), freq))
        return _emit(bb, op.cos(op.concat([angles, angles], axis=-1)))
    return body


def test_a_rotary_table_is_sliced_from_its_value_at_the_bound():
    mod = _module(_rotary(), bounds=(1, 40), shape=lambda s: (s, 16))
    (binding, _) = ComputeClosedForms()(mod)["main"].body.blocks[0].bindings
    assert binding.value.op.name == "relax.strided_slice"
    assert binding.value.args[0].value.numpy().shape == (40, 16)
    _check_against_default(mod, (1, 9, 40), shape=lambda s: (s, 16))


def test_a_rotary_table_without_an_upper_bound_keeps_its_ops():
    mod = _module(_rotary(), bounds=None, shape=lambda s: (s, 16))
    assert "R.cos" in ComputeClosedForms()(mod)["main"].script()
    _check_against_default(mod, (3, 9), shape=lambda s: (s, 16))


def test_a_table_whose_elements_read_the_size_keeps_its_ops():
    # positions s .. 2s - 1: the value at index i depends on s, so no table at the bound holds it
    mod = _module(_rotary(start=lambda s: s, stop=lambda s: 2 * s), shape=lambda s: (s, 16))
    forms = closed_forms(mod["main"])
    assert not forms[list(forms)[-1]].sizes_free()
    assert "R.cos" in ComputeClosedForms()(mod)["main"].script()
    _check_against_default(mod, (2, 11), shape=lambda s: (s, 16))


def test_a_cumsum_of_a_varying_summand_keeps_its_scan():
    mod = _module(lambda bb, s: _emit(bb, op.cumsum(op.arange(0, s, 1, I64), axis=0)), shape=lambda s: (s,))
    assert "cumsum" in ComputeClosedForms()(mod)["main"].script()
    _check_against_default(mod, (1, 6), shape=lambda s: (s,))


def test_a_gather_not_proven_in_bounds_has_no_closed_form():
    def body(bb, s):
        return _emit(bb, op.take(op.arange(0, s, 1, I64), op.arange(1, s + 1, 1, I64), axis=0, mode="clip"))

    mod = _module(body, shape=lambda s: (s,))
    bindings = mod["main"].body.blocks[0].bindings
    forms = closed_forms(mod["main"])
    take = next(b for b in bindings if isinstance(b.value, relax.Call) and b.value.op.name == "relax.take")
    assert take.var not in forms
    assert "take" in ComputeClosedForms()(mod)["main"].script()


def test_index_maps_compose_exactly():
    def body(bb, s):
        grid = _emit(bb, op.reshape(op.arange(0, 6 * s, 1, I64), [s, 2, 3]))  # (s, 2, 3)
        moved = _emit(bb, op.permute_dims(grid, [2, 0, 1]))  # (3, s, 2)
        tail = _emit(bb, op.strided_slice(moved, [0, 2], [-2, 1], [3, 2], [1, 1]))  # (2, s, 1)
        squeezed = _emit(bb, op.squeeze(tail, [2]))  # (2, s)
        flipped = _emit(bb, op.strided_slice(squeezed, [0], [0], [2], [1]))
        joined = _emit(bb, op.concat([flipped, squeezed, op.negative(squeezed)], axis=0))  # (6, s)
        picked = _emit(bb, op.take(joined, op.arange(0, s, 1, I64), axis=1))
        return _emit(bb, op.where(op.greater(picked, relax.const(4, I64)), picked,
                                  op.maximum(picked, relax.const(-3, I64))))

    mod = _module(body, shape=lambda s: (6, s))
    forms = closed_forms(mod["main"])
    assert len(forms) == len(mod["main"].body.blocks[0].bindings) - 1  # all but the output, which reads x
    assert "take" not in ComputeClosedForms()(mod)["main"].script()
    _check_against_default(mod, (1, 4, 13), shape=lambda s: (6, s))


def test_proofs_use_the_function_bounds_of_its_sizes():
    # arange(s)[2:]: its begin is in bounds only where s >= 2, which the lower bound says or not
    def body(bb, s):
        return _emit(bb, op.strided_slice(op.arange(0, s, 1, I64), [0], [2], [s], assume_inbound=True))

    for lower, closed in ((3, True), (1, False)):
        mod = _module(body, bounds=(lower, 17), shape=lambda s: (s - 2,))
        facts = Facts.of_function(mod["main"])
        ((var, bound),) = facts.bounds.items()
        assert var.name == "s" and bound == (lower, 17)
        sliced = mod["main"].body.blocks[0].bindings[1]
        assert (derive(sliced.value, closed_forms(mod["main"]), facts) is not None) == closed


def test_a_static_mask_too_large_to_fold_becomes_a_kernel_of_no_input():
    # FoldHostConstants folds the (2, 1500) cumsum (all zeros) but not the 2 x 1500 x 1500 mask (4.5 MB of
    # bools, over its 4 MiB): the mask is then a select of its indices, read from no tensor
    length = 1500

    def masked_softmax(bb, s):
        return _emit(bb, op.nn.softmax(op.add(op.zeros((2, length, length), "float32"), _packed_mask(bb, length))))

    mod = _module(masked_softmax, bounds=None, shape=lambda s: (2, length, length))
    script = ComputeClosedForms()(FoldHostConstants()(mod))["main"].script()
    assert "closed_form" in script and "index_tensor" not in script
    built = build(mod, CUDA, stitched=True)
    assert count_launches(built.lowered, built.executable) == 1


def _random_index_chain(seed: int):
    """A random chain of the rules' ops over (2, s) int64 values of `arange`s, ending in its float32 sum."""
    rng = np.random.default_rng(seed)

    def body(bb, s):
        row = _emit(bb, op.broadcast_to(op.reshape(op.arange(0, s, 1, I64), [1, s]), relax.ShapeExpr([2, s])))
        col = _emit(bb, op.broadcast_to(op.reshape(op.arange(0, 2, 1, I64), [2, 1]), relax.ShapeExpr([2, s])))
        values = [row, col]
        for _ in range(6):
            a, b = (values[i] for i in rng.integers(0, len(values), 2))
            k = relax.const(int(rng.integers(-3, 4)), I64)
            choice = int(rng.integers(0, 8))
            if choice == 0:
                value = op.add(a, op.multiply(b, k))
            elif choice == 1:
                value = op.where(op.greater(a, b), a, op.subtract(b, k))
            elif choice == 2:
                value = op.maximum(a, op.minimum(b, k))
            elif choice == 3:  # rotate by one along s: a[:, 1:] ++ a[:, :1]
                value = op.concat([op.strided_slice(a, [1], [1], [s], assume_inbound=True),
                                   op.strided_slice(a, [1], [0], [1], assume_inbound=True)], axis=1)
            elif choice == 4:  # a cumsum of a constant summand, or of a varying one (kept as a scan)
                summand = op.equal(a, a) if rng.integers(0, 2) else op.greater(a, k)
                value = op.cumsum(summand, axis=1, dtype=I64, exclusive=bool(rng.integers(0, 2)))
            elif choice == 5:  # gather along s at reversed positions
                reverse = op.subtract(relax.const(0, I64), op.arange(1 - s, 1, 1, I64))
                value = op.take(a, reverse, axis=1)
            elif choice == 6:
                value = op.astype(op.logical_and(op.less_equal(a, b), op.not_equal(a, k)), I64)
            else:
                value = op.reshape(op.permute_dims(op.reshape(a, [2, s, 1]), [2, 0, 1]), [2, s])
            values.append(_emit(bb, value))
        return values[-1]

    return body


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_of_indices_match_tvms_default_build(seed):
    mod = _module(_random_index_chain(seed), bounds=(1, 32))
    _check_against_default(mod, (1, 2, 7, 32))
