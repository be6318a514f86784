"""Every memory-intensive Relax op of TVM's registry builds stitched wherever TVM's default builds,
and matches it on llvm (tvm_stitch/tools/op_sweep.py). The default run checks a sample; the whole
sweep is the slow tier (`pytest -m slow tests/test_op_sweep.py`)."""

import warnings

import numpy as np
import pytest
import tvm

import tvm_stitch
from schedules.intrinsics import expand_intrinsics
from tvm_stitch.target import host_target
from tvm_stitch.tools import op_sweep
from tvm_stitch.tools.build import build, run_cpu

# One op per class and per kind of argument construction: libm-only intrinsics (cosh, sinh),
# comparisons to bool, integer bit operations, broadcasts, gathers by SPECIAL, reductions.
SAMPLE = [("relax.cosh", "float32", "chain"), ("relax.sinh", "bfloat16", "alone"),
          ("relax.less", "int32", "chain"), ("relax.left_shift", "int64", "alone"),
          ("relax.where", "float16", "chain"), ("relax.broadcast_to", "bool", "chain"),
          ("relax.nn.softmax", "float32", "chain"), ("relax.max", "int32", "alone"),
          ("relax.strided_slice", "float32", "chain")]


def test_registry_enumeration_classifies_the_memory_intensive_ops():
    swept = {c.name: c for c in op_sweep.swept_ops()}
    assert len(swept) >= 100
    assert swept["relax.cosh"].kind == "element-wise"
    assert swept["relax.broadcast_to"].kind == "broadcast"
    assert swept["relax.sum"].kind == "reduction" and swept["relax.nn.softmax"].kind == "reduction"
    assert set(swept["relax.add"].dtypes) == set(op_sweep.DTYPES)
    assert "bool" not in swept["relax.exp"].dtypes
    assert op_sweep.classify("relax.nn.conv2d").kind == "out-element-wise-fusable"
    assert op_sweep.classify("relax.take").kind == "opaque"
    assert all(n.startswith("relax.") for n in op_sweep.registered_ops())


@pytest.mark.parametrize("op, dtype, form", SAMPLE)
def test_sample_matches_default_on_llvm_and_builds_for_cuda(op, dtype, form):
    case = op_sweep.Case(op, dtype, form)
    chosen = op_sweep.targets()
    for label in ("llvm-host", "cuda-sm_90"):
        result = op_sweep.check(case, label, chosen[label])
        assert result.status == ("match" if label.startswith("llvm") else "built"), (label, result)
        assert result.stitched >= 1 and not result.fallbacks, (label, result)


@pytest.mark.slow
def test_whole_sweep():
    results = op_sweep.sweep()
    summary = op_sweep.summary(results)
    assert not summary["failures"], summary["failures"][:10]


def test_close_compares_nan_patterns_and_exact_integers():
    from tvm_stitch.tools.tolerance import close

    nan = np.array([np.nan, 1.0, np.inf], "float32")
    assert close(nan, nan.copy(), "float32")
    assert not close(nan, np.array([0.0, 1.0, np.inf], "float32"), "float32")
    assert not close(nan, np.array([np.nan, 1.0, -np.inf], "float32"), "float32")
    assert not close(np.array([3], "int64"), np.array([4], "int64"), "int64")


@pytest.mark.parametrize("name", ["cosh", "sinh"])
def test_torch_hyperbolic_modules_stitch_and_match(name):
    torch = pytest.importorskip("torch")

    class Module(torch.nn.Module):
        def forward(self, x):
            return getattr(torch, name)(x)

    x = torch.linspace(-10, 10, 64).reshape(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = tvm_stitch.from_torch(Module(), (x,))
    built = build(mod, host_target(), stitched=True)
    assert len(built.report.plans) == 1 and not built.report.fallbacks
    (got,) = run_cpu(built.executable, [x.numpy()])
    np.testing.assert_allclose(got, getattr(torch, name)(x).numpy(), rtol=2e-6)


@pytest.mark.parametrize("dtype, top, ulps", [("float32", 89.4, 3), ("float64", 710.4, 3)])
@pytest.mark.parametrize("name", ["cosh", "sinh"])
def test_expanded_hyperbolics_are_within_a_few_ulps_up_to_overflow(name, dtype, top, ulps):
    x_ = tvm.te.placeholder((4096,), dtype, name="x")
    y_ = tvm.te.compute((4096,), lambda i: getattr(tvm.tirx, name)(x_[i]), name="y")
    func = expand_intrinsics(tvm.te.create_prim_func([x_, y_]))
    assert name not in func.script()
    sch = tvm.s_tir.Schedule(func)
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 8])
    sch.vectorize(inner)
    kernel = tvm.compile(sch.mod, target=host_target())
    x = np.concatenate([np.linspace(-top, top, 4000), np.linspace(-1.1, 1.1, 96)]).astype(dtype)
    out = tvm.runtime.tensor(np.zeros(4096, dtype))
    kernel(tvm.runtime.tensor(x), out)
    want = getattr(np, name)(x.astype(np.float64))
    got = out.numpy().astype(np.float64)
    assert np.all(np.isfinite(got))
    eps = np.finfo(dtype).eps
    assert np.max(np.abs(got - want) / np.abs(want).clip(1e-300)) <= ulps * eps


def test_kernel_llvm_rejects_falls_back_with_its_reason(monkeypatch):
    """Without the expansion, a vectorised cosh reaches LLVM's code generation, which rejects it: the
    build check sees it and the group falls back instead of failing the build."""
    import schedules

    monkeypatch.setattr(schedules, "expand_intrinsics", lambda func: func)
    mod = op_sweep.Case("relax.cosh", "float32", "chain").module()
    built = build(mod, host_target(), stitched=True)
    reasons = [g.fallback for g in built.report.fallbacks]
    assert reasons and all("unknown intrinsic" in r and "cosh" in r for r in reasons), reasons
    default = build(mod, host_target(), stitched=False)
    x = np.linspace(-3, 3, 32, dtype="float32").reshape(4, 8)
    np.testing.assert_allclose(run_cpu(built.executable, [x])[0], run_cpu(default.executable, [x])[0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_batch_norm_is_widened_whole_and_feeds_a_widened_sum(dtype):
    """batch_norm returns a tuple: it is computed on float32 tensors and each field cast back. Left in
    half precision, TOPI computes its output in float32 under a half-precision type, legalization
    re-types its readers, and a sum widened and cast back made `subtract` an op of mixed dtypes
    (TypeError in the stitched CUDA build)."""
    from tvm import relax

    from tvm_stitch.rewrites.precision import AccumulateInFloat32

    mod = op_sweep.Case("relax.nn.batch_norm", dtype, "chain").module()
    widened = AccumulateInFloat32()(mod)
    calls = []
    relax.analysis.post_order_visit(widened["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) and getattr(e.op, "name", "") == "relax.nn.batch_norm" else None)
    assert len(calls) == 1 and all(str(a.ty.dtype) == "float32" for a in calls[0].args)
    legalized = relax.transform.LegalizeOps()(widened)
    assert str(legalized["main"].ret_ty.dtype) == dtype

    built = build(mod, op_sweep.targets()["cuda-sm_80"], stitched=True, strict=True)
    assert built.report.plans and not built.report.fallbacks

    inputs, _ = op_sweep._call("relax.nn.batch_norm", dtype)
    x, gamma, beta, mean, var = [inp.draw(np.random.default_rng(k)) for k, inp in enumerate(inputs)]
    (got,) = run_cpu(build(widened, host_target(), stitched=False).executable, [x, gamma, beta, mean, var])
    col = lambda v: v.astype(np.float64).reshape(1, 4, 1)  # noqa: E731 - the channel axis
    norm = (x.astype(np.float64) - col(mean)) / np.sqrt(col(var) + 1e-5) * col(gamma) + col(beta)
    np.testing.assert_allclose(got.astype(np.float64), norm - norm.sum(-1, keepdims=True), rtol=0.05, atol=0.1)


def test_bool_product_on_cuda_falls_back_with_tvms_reason():
    """TVM's cross-thread reduction lowering cannot reduce bools; the modeled-time pricing of such a
    kernel once raised AttributeError (an exception class this TVM lacks) instead of leaving it
    unpriced, and the reason read the TVMScript's last line instead of TVM's message."""
    result = op_sweep.check(op_sweep.Case("relax.prod", "bool", "alone"), "cuda-sm_90",
                            op_sweep.targets()["cuda-sm_90"])
    assert result.status == "built" and result.stitched == 0, result
    assert result.fallbacks == ["InternalError: Cannot decide max_value for typeT.bool"], result


def test_a_logged_sweep_resumes_without_rerunning_its_cases(tmp_path):
    import json

    case = op_sweep.Case("relax.cosh", "float32", "chain")
    done = op_sweep.Result(case, "cuda-sm_90", "built", fallbacks=["a reason"], stitched=1)
    log = tmp_path / "sweep.jsonl"
    log.write_text(json.dumps(op_sweep.to_record(done)) + "\n")
    assert op_sweep.read_log(str(log)) == [done]
    assert op_sweep.read_log(str(tmp_path / "none.jsonl")) == []
    assert op_sweep.sweep([case], ["cuda-sm_90"], done={("relax.cosh", "float32", "chain", "cuda-sm_90")}) == []
