"""Candidates, features and the learned cost model: valid choices, deterministic features, fallbacks."""

import json
import math

import numpy as np
import pytest

import tvm_stitch
from tvm_stitch.stitch import block_rewriter, kernel_maker
from tvm_stitch.planning import cost_model
from tvm_stitch.tools.tolerance import tolerance
from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.planning.candidates import candidates, knobs
from tvm_stitch.tools.cli import main
from tvm_stitch.tools.evaluate import evaluate
from tvm_stitch.planning.features import FEATURES, features, group_facts
from tvm_stitch.tools.workloads import SUITE, dims, reference
from tvm_stitch.tools.tune import fused_groups, read_records, tune

from conftest import CUDA, LLVM


class _Forcing:
    """A model that ranks candidate `index` (modulo the group's count) of every group first."""

    def __init__(self, index: int):
        self.index = index
        self.seen = []  # candidates per group with a choice

    def costs(self, rows: list) -> list:
        self.seen.append(len(rows))
        return [0.0 if i == self.index % len(rows) else 1.0 for i in range(len(rows))]


def _check_graph(name: str, dtype: str, index: int, rng, emulate=None) -> int:
    graph = SUITE[name]
    d = dims("test")
    inputs = graph.inputs(rng, dtype, d)
    model = _Forcing(index)
    built = build(graph.build(dtype, d), LLVM, stitched=True, strict=True, emulate=emulate, cost_model=model)
    rtol, atol = tolerance(dtype)
    for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, inputs)):
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol)
    if index % max(model.seen, default=1):
        assert any("cost model: candidate" in n for p in built.report.plans for n in p.notes)
    return max(model.seen, default=1)


@pytest.mark.parametrize("name, dtype, step", [("layernorm_softmax", "float32", 1),
                                               ("attention_softmax", "float32", 3),
                                               ("bias_gelu", "float16", 2)])
def test_every_cpu_candidate_builds_and_matches_numpy(name, dtype, step, rng):
    count = _check_graph(name, dtype, 0, rng)
    assert count >= 4
    for index in range(step, count, step):
        _check_graph(name, dtype, index, rng)


def test_cuda_candidates_run_without_thread_bindings(rng):
    count = _check_graph("softmax", "float32", 0, rng, emulate="cuda")
    assert count >= 4
    for index in range(1, count, max(1, count // 4)):
        _check_graph("softmax", "float32", index, rng, emulate="cuda")


def test_cpu_candidates_vary_cores_lanes_and_rows():
    mod = SUITE["attention_softmax"].build("float32", dims("test"))
    (fused, rule), = fused_groups(mod, LLVM)
    plans = candidates(fused, rule, rule.spec)
    assert plans[0] is rule
    seen = [tuple(sorted(knobs(p).items())) for p in plans]
    assert len(seen) == len(set(seen))
    assert {p.rank for p in plans} == {1, 2, 3}
    assert {p.mapping.threads for p in plans} == {1, rule.spec.cores}  # serial, or every core
    assert 1 in {p.mapping.vector for p in plans} and len({p.mapping.vector for p in plans}) == 4
    for plan in plans:
        assert plan.mapping.rows == math.prod(int(r) for r in plan.row_shape)


@pytest.mark.parametrize("target", [LLVM, CUDA], ids=["cpu", "cuda"])
def test_features_are_deterministic(target):
    mod = SUITE["layernorm_backward"].build("float32", dims("test"))
    for (fused, rule), (again, rule_again) in zip(fused_groups(mod, target), fused_groups(mod, target)):
        first = [features(group_facts(fused), p, rule) for p in candidates(fused, rule, rule.spec)]
        second = [features(group_facts(again), p, rule_again) for p in candidates(again, rule_again, rule.spec)]
        assert first == second
        assert all(len(row) == len(FEATURES) and all(math.isfinite(v) for v in row) for row in first)
        assert sum(row[FEATURES.index("rule")] for row in first) == 1


def _tiny_records(n_groups: int = 6, per_group: int = 5) -> list:
    rng = np.random.default_rng(7)
    records = []
    for g in range(n_groups):
        entries = []
        for c in range(per_group):
            x = rng.uniform(0, 4, size=len(FEATURES)).round(3).tolist()
            entries.append({"knobs": {"rank": 1, "threads": 1, "vector": c, "rows_per_task": 1}, "features": x,
                            "ms": float(0.1 + x[0] + 0.5 * x[5]), "agrees": True, "rule": c == 0})
        records.append({"group": f"g{g}", "ops": ["op"], "candidates": entries})
    return records


def test_train_reproduces_the_model_and_the_python_walk_matches_xgboost(tmp_path):
    import xgboost as xgb

    records = _tiny_records()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    cost_model.train(records, first)
    cost_model.train(records, second)
    assert first.read_bytes() == second.read_bytes()
    model = cost_model.Model.from_json(first.read_text())
    assert model.feature_names == FEATURES
    rows = [c["features"] for r in records for c in r["candidates"]]
    booster = xgb.Booster(model_file=str(first))
    want = booster.predict(xgb.DMatrix(np.asarray(rows, dtype=np.float32), feature_names=list(FEATURES)))
    np.testing.assert_allclose(model.predict(rows), want, rtol=1e-5, atol=1e-5)


def test_shipped_model_loads_and_picks_a_candidate():
    model = cost_model.load_model("cpu")
    assert model is not None, f"no usable model at {cost_model.model_path('cpu')}"
    mod = SUITE["softmax"].build("float32", dims("test"))
    (fused, rule), = fused_groups(mod, LLVM)
    chosen = cost_model.choose(model, fused, rule, rule.spec)
    assert knobs(chosen) in [knobs(p) for p in candidates(fused, rule, rule.spec)]
    assert cost_model.load_model("cuda") is None  # no CUDA model: the rules decide there
    assert set(cost_model.SHIPPED) == {"cpu"} and cost_model.SHIPPED["cpu"].feature_names == FEATURES


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"learner": {}})])
def test_no_usable_model_loads_as_none(content, tmp_path):
    if content is not None:
        (tmp_path / "cpu.json").write_text(content)
    assert cost_model.load_model("cpu", tmp_path) is None


def test_cuda_chooses_in_time_where_no_learned_model_is_shipped():
    """No learned CUDA model: cost_model=True keeps the rule plan or a variant the time model prices lower."""
    mod = SUITE["layernorm"].build("float32", dims("test"))
    with_model = tvm_stitch.explain(mod, CUDA)
    assert cost_model.load_model("cuda") is None
    rules = build(mod, LLVM, stitched=True, strict=True, emulate="cuda", cost_model=False)
    assert with_model.plans and len(with_model.plans) == len(rules.report.plans)
    for chosen, rule in zip(with_model.plans, rules.report.plans):
        assert 0 < chosen.modeled_us <= rule.modeled_us and chosen.kernels == rule.kernels


def test_rule_plan_is_built_when_the_models_choice_does_not_build(monkeypatch, rng):
    original = kernel_maker.schedule_for

    def refuse_choices(func, plan, target):
        if any(note.startswith("cost model:") for note in plan.notes):
            raise RuntimeError("injected: the chosen schedule does not build")
        return original(func, plan, target)

    monkeypatch.setattr(kernel_maker, "schedule_for", refuse_choices)
    graph = SUITE["softmax"]
    model = _Forcing(1)
    built = build(graph.build("float32", dims("test")), LLVM, stitched=True, strict=True, cost_model=model)
    assert model.seen and max(model.seen) > 1  # the model did choose another candidate
    (plan,) = built.report.plans
    assert not any(note.startswith("cost model:") for note in plan.notes)
    assert any("choice did not build" in n and "rule plan is used" in n for n in built.report.notes)
    rules = build(graph.build("float32", dims("test")), LLVM, stitched=True, strict=True, cost_model=False)
    assert plan.mapping == rules.report.plans[0].mapping
    inputs = graph.inputs(rng, "float32", dims("test"))
    (out,) = run_cpu(built.executable, inputs)
    np.testing.assert_allclose(out.astype(np.float64), reference(graph, inputs)[0], rtol=2e-4, atol=2e-4)


def test_the_model_adds_no_builds_at_compile_time(monkeypatch):
    """Candidates are ranked from features: compiling with the model builds the same kernels as without."""
    calls = []
    original = kernel_maker.check_builds
    for module in (kernel_maker, block_rewriter):  # a kernel's check, a pack's check
        monkeypatch.setattr(module, "check_builds", lambda f, t: (calls.append(1), original(f, t)))
    mod = SUITE["layernorm_backward"].build("float32", dims("test"))
    build(mod, LLVM, stitched=True, cost_model=False)
    without = len(calls)
    build(mod, LLVM, stitched=True, cost_model=True)
    assert len(calls) - without == without
    with pytest.raises(TypeError, match="cost_model"):
        tvm_stitch.StitchFusion(LLVM, cost_model="yes")


def test_tune_writes_records_and_resumes(tmp_path):
    path = tmp_path / "records.jsonl"
    shapes = {"tiny": dims("test")}
    first = tune(path, shapes, ["rmsnorm"], ("float32",), LLVM, progress=lambda m: None)
    assert first["measured"] == 1 and not first["disagreeing"] and not first["failed"]
    groups = [r for r in read_records(path) if "candidates" in r]
    assert all(c["ms"] > 0 and c["agrees"] for c in groups[0]["candidates"])
    assert sum(c["rule"] for c in groups[0]["candidates"]) == 1
    again = tune(path, shapes, ["rmsnorm"], ("float32",), LLVM, progress=lambda m: None)
    assert again["measured"] == 0 and len(read_records(path)) == 2

    result = evaluate(path, tmp_path / "evaluation", compile_graphs=False, bench_graphs=False,
                      progress=lambda m: None)
    assert result["summary"]["groups"] == 1
    assert (tmp_path / "evaluation" / "evaluation.md").read_text().startswith("# Cost model evaluation")
    (row,) = json.loads((tmp_path / "evaluation" / "evaluation.json").read_text())["groups"]
    times = [c["ms"] for c in groups[0]["candidates"]]
    assert row["best_ms"] == min(times) and row["model_ms"] in times
    assert row["model_over_best"] == pytest.approx(row["model_ms"] / min(times))

    model = tmp_path / "model.json"
    assert main(["train", "--records", str(path), "--out", str(model)]) == 0
    assert cost_model.Model.from_json(model.read_text()).feature_names == FEATURES
