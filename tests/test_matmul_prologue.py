"""The steps of the prologue folding (PrologueFolder), each on its own."""

from tvm import relax

from tvm_stitch.rewrites.matmul_composition import call_tir_bindings
from tvm_stitch.rewrites.matmul_prologue import PrologueFolder
from tvm_stitch.report import StitchReport

from conftest import CUDA, legalized, make_module, tensor

B, T, HEADS, D = 2, 8, 2, 16
HIDDEN = HEADS * D
op = relax.op


def _calls(mod, name_start: str) -> list:
    """The call_tir calls of main whose callee's name starts with `name_start`, in binding order."""
    return [c for c in call_tir_bindings(mod["main"]).values() if c.args[0].name_hint.startswith(name_start)]


def _qkv_split():
    x, w = tensor("x", (B * T, HIDDEN)), tensor("w", (HIDDEN, 3 * HIDDEN))

    def body(bb, x, w):
        qkv = bb.emit(op.split(op.matmul(x, w), 3, axis=1))
        q, k = (bb.emit(op.permute_dims(relax.TupleGetItem(qkv, i), [1, 0])) for i in range(2))
        return bb.emit(op.matmul(q, op.permute_dims(k, [1, 0])))

    return legalized(make_module([x, w], body))


def test_an_output_of_a_split_becomes_a_copy_of_its_own_made_once():
    mod = _qkv_split()
    folder = PrologueFolder(mod, CUDA)
    (split,) = _calls(mod, "split")
    first = folder.output_call(split, 1)
    assert first is not None and first.args[0].name_hint == f"{split.args[0].name_hint}_1"
    assert first.ty_args[0] == split.ty_args[0].fields[1]
    assert len(folder.mod.functions) == len(mod.functions) + 1
    again = folder.output_call(split, 1)
    assert again.args[0].same_as(first.args[0]) and len(folder.mod.functions) == len(mod.functions) + 1
    # an output no call uses is dropped from the module at the end
    assert first.args[0] not in folder.module().get_global_vars()


def test_a_refused_composition_is_tried_once_and_noted_once():
    x, w = tensor("x", (4 * D,)), tensor("w", (4 * D, D))
    mod = legalized(make_module([x, w], lambda bb, x, w: bb.emit(op.matmul(op.expand_dims(x, 0), w))))
    report = StitchReport()
    folder = PrologueFolder(mod, CUDA, report)
    calls = call_tir_bindings(mod["main"])
    ((var, matmul),) = [(v, c) for v, c in calls.items() if c.args[0].name_hint.startswith("matmul")]
    (copy_var,) = [v for v, c in calls.items() if c.args[0].name_hint.startswith("expand_dims")]
    chain = [(copy_var, calls[copy_var])]
    assert folder.fold(matmul, chain, note=True) is None
    assert folder.fold(matmul, chain, note=True) is None
    assert len(folder.composed) == 1 and len(report.notes) == 1 and "expand_dims stays a kernel" in report.notes[0]
    assert len(folder.mod.functions) == len(mod.functions)  # nothing scheduled, nothing added


def test_identical_compositions_share_one_trial_and_one_function():
    x, v = tensor("x", (B * T, HIDDEN)), tensor("v", (B * T, HIDDEN))
    y = tensor("y", (B * T, HIDDEN))

    def body(bb, x, y, v):
        a = bb.emit(op.matmul(op.permute_dims(x, [1, 0]), v))
        b = bb.emit(op.matmul(op.permute_dims(y, [1, 0]), v))
        return bb.emit(relax.Tuple([a, b]))

    mod = legalized(make_module([x, y, v], body))
    folder = PrologueFolder(mod, CUDA)
    folded, refused = folder.fold_chains(mod["main"], set())
    assert not refused
    callees = [c.args[0] for c in call_tir_bindings(folded).values()]
    prologues = [gv for gv in callees if gv.name_hint.endswith("_prologue")]
    assert len(prologues) == 2 and prologues[0].same_as(prologues[1])  # one function for both matmuls
    assert not [gv for gv in callees if gv.name_hint.startswith("transpose")]
    assert sum(len(same) for same in folder.tried.values()) == 1


def test_a_round_folds_nothing_where_no_producer_feeds_only_matmuls():
    x, w = tensor("x", (B * T, HIDDEN)), tensor("w", (HIDDEN, HIDDEN))
    mod = legalized(make_module([x, w], lambda bb, x, w: bb.emit(op.matmul(op.multiply(x, relax.const(2.0)), w))))
    folder = PrologueFolder(mod, CUDA)
    assert folder.fold_round(mod["main"], set()) is None
    assert folder.fold_chains(mod["main"], set()) == (mod["main"], False)


def test_fold_function_gives_the_module_the_rewritten_function():
    mod = _qkv_split()
    folder = PrologueFolder(mod, CUDA)
    folder.fold_function(mod.get_global_var("main"), mod["main"])
    out = folder.module()
    names = [c.args[0].name_hint for c in call_tir_bindings(out["main"]).values()]
    assert not [n for n in names if n.startswith(("split", "transpose"))], names
