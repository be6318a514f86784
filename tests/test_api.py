"""The public API: pipeline, StitchFusion, explain, plans; clear errors for bad input."""

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.tools.suite import SUITE, dims

from conftest import LLVM


def _mod():
    return SUITE["layernorm_softmax"].build("float32", dims("test"))


@pytest.mark.parametrize("target", [{"kind": "llvm"}, {"kind": "cuda", "arch": "sm_90"}, "llvm"])
def test_pipeline_is_a_drop_in_relax_pipeline(target):
    ex = tvm.compile(_mod(), target=tvm.target.Target(target), relax_pipeline=tvm_stitch.pipeline(target))
    assert ex is not None


def test_pipeline_runs_on_cpu():
    ex = tvm.compile(_mod(), target=LLVM, relax_pipeline=tvm_stitch.pipeline(LLVM))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.random.default_rng(0).standard_normal((64, 96)).astype("float32")
    ones, zeros = np.ones(96, "float32"), np.zeros(96, "float32")
    out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, ones, zeros)]).numpy()
    np.testing.assert_allclose(out.sum(-1), np.ones(64), rtol=1e-5)


@pytest.mark.parametrize("target, message", [
    ({"kind": "c"}, "target kinds"),
    ("not-a-target-kind", "invalid target"),
    (42, "target must be"),
])
def test_bad_targets_are_named(target, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tvm_stitch.pipeline(target)


def test_explain_rejects_non_modules():
    with pytest.raises(TypeError, match="IRModule"):
        tvm_stitch.explain("not a module", LLVM)


def test_stitch_fusion_composes_in_a_custom_pipeline():
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        tvm_stitch.StitchFusion(LLVM),
        relax.transform.FuseTIR(),
    ])
    out = seq(_mod())
    plans = [f.attrs["tvm_stitch.plan"] for _, f in out.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "tvm_stitch.plan" in f.attrs]
    assert len(plans) == 1
    assert StitchPlan.from_json(str(plans[0])).scheme == "row-resident"


def test_stitch_fusion_needs_a_target():
    with pytest.raises(ValueError, match="needs a target"):
        tvm_stitch.StitchFusion()(relax.transform.FuseOps()(relax.transform.LegalizeOps()(_mod())))


def test_explain_reports_plan_per_kernel():
    report = tvm_stitch.explain(_mod(), {"kind": "cuda", "arch": "sm_90"})
    (plan,) = report.plans
    assert plan.scheme == "row-resident"
    assert plan.dominant and plan.mapping.threads >= 32
    levels = {i.level for i in plan.intermediates}
    assert {"register", "shared"} <= levels
    table = report.table()
    for column in ("kernel", "ops", "scheme", "dominant", "mapping", "reuse"):
        assert column in table
    assert "shared" in report.details()


def test_plan_round_trips_through_json():
    (plan,) = tvm_stitch.explain(_mod(), LLVM).plans
    assert StitchPlan.from_json(plan.to_json()) == plan
