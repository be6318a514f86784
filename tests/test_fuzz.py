"""Random graphs: the stitched build agrees with TVM's default build; the saved failing graphs pass."""

import glob
import os

import pytest

from tvm_stitch.tools.fuzz import Spec, Step, build_module, check_spec, fuzz, random_spec, shrink

REGRESSIONS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "regressions", "*.json")))
# The default run draws 16 graphs (the registry's ops make each graph dearer to build) in CHUNKS
# tests of consecutive seeds, so that parallel test workers share them; the slow tier 200.
CI_GRAPHS = int(os.environ.get("TVM_STITCH_FUZZ_GRAPHS", "16"))
CHUNKS = 4


def _agree(graphs: int, seed: int = 0) -> None:
    summary = fuzz(graphs, seed=seed, cuda=True, nvcc_every=50)
    assert summary["graphs"] == graphs
    assert summary["stitched_kernels"] > graphs // 2
    assert not summary["failures"], summary["failures"][:3]


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_graphs_agree_with_default_build(chunk):
    first, last = CI_GRAPHS * chunk // CHUNKS, CI_GRAPHS * (chunk + 1) // CHUNKS
    _agree(last - first, seed=first)


@pytest.mark.slow
def test_two_hundred_random_graphs_agree_with_default_build():
    _agree(200)


def test_symbolic_graphs_run_at_several_sizes():
    checked = 0
    for seed in range(400):
        spec = random_spec(seed, symbolic=True)
        if not spec.sizes:
            continue
        assert len(spec.sizes["n"]) >= 3
        outcome = check_spec(spec, seed=seed, cuda=True)
        assert outcome.ok, (seed, outcome.message)
        assert outcome.stitched_kernels and not outcome.fallbacks, (seed, outcome)
        checked += 1
        if checked == 8:
            break
    assert checked == 8


@pytest.mark.parametrize("path", REGRESSIONS, ids=[os.path.basename(p) for p in REGRESSIONS])
def test_saved_regressions(path):
    with open(path, encoding="utf-8") as f:
        spec = Spec.from_json(f.read())
    outcome = check_spec(spec, cuda=True)
    assert outcome.ok, outcome.message


def test_specs_round_trip_and_build():
    spec = random_spec(7)
    again = Spec.from_json(spec.to_json())
    assert again == spec
    assert build_module(again)["main"] is not None


def test_shrink_keeps_the_failure_and_drops_the_rest():
    spec = Spec(inputs=[[[4, 8], "float32"]],
                steps=[Step("exp", [0]), Step("tanh", [1]), Step("sum", [2], {"axes": [1], "keepdims": True})],
                outputs=[3])
    # "Fails" while a tanh remains: shrinking must keep it and drop exp and sum.
    small = shrink(spec, lambda s: any(step.op == "tanh" for step in s.steps))
    assert [s.op for s in small.steps] == ["tanh"]
