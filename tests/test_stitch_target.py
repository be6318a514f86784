"""One StitchTarget carried to every pass: `spec=` and `emulate=` reach the rewrites, the pricers and the stitch pass."""

import dataclasses

import tvm
from tvm import relax

from tvm_stitch.pipeline import stitch_passes
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.rewrites.epilogue_price import EpiloguePricer
from tvm_stitch.rewrites.matmul_prologue import PrologueFolder
from tvm_stitch.stitch_target import StitchTarget
from tvm_stitch.tools.workloads.attention import Chain
from tvm_stitch.tools.workloads.relax_blocks import function, tensor

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
LLVM = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})


def _attention_and_scatter() -> tvm.IRModule:
    """An attention chain, then an embedding gradient (an accumulating scatter) and a softmax."""
    chain = Chain(1, 2, 16, 16, 64).module()
    params = [tensor("ids", (4, 8), "int64"), tensor("grad", (4, 8, 32), "float32")]

    def body(bb, ids, grad):
        zeros = bb.emit(relax.op.full((64, 32), relax.const(0.0, "float32"), "float32"))
        table = bb.emit(relax.op.scatter_nd(zeros, bb.emit(relax.op.expand_dims(ids, [-1])), grad, "add"))
        return relax.op.nn.softmax(table, axis=-1)

    scatter = function(params, body)
    return tvm.IRModule({**dict(chain.functions_items()), "scatter": scatter["main"].with_attr("global_symbol", "scatter")})


def _stitched(target, **options) -> StitchReport:
    report = StitchReport()
    made = StitchTarget.make(target, options.pop("emulate", None), options.pop("spec", None))
    with made.target:
        tvm.transform.Sequential(stitch_passes(made, report=report, strict=True))(_attention_and_scatter())
    return report


def test_spec_reaches_the_rewrites_and_the_stitch_pass():
    spec = dataclasses.replace(TargetSpec.from_target(CUDA), sms=66)
    report = _stitched(CUDA, spec=spec)
    assert report.spec is spec
    fused = [r.plan for r in report.attention if r.plan is not None]
    assert fused and all(plan.spec == spec for plan in fused)
    assert report.scatters and all(r.plan is not None and r.plan.spec == spec for r in report.scatters)
    assert report.plans and all(plan.spec == spec for plan in report.plans)


def test_spec_reaches_the_matmul_boundary_pricers():
    spec = dataclasses.replace(TargetSpec.from_target(CUDA), sms=66)
    made = StitchTarget.make(CUDA, spec=spec)
    assert EpiloguePricer(made).spec is spec
    assert PrologueFolder(_attention_and_scatter(), made).spec is spec
    assert EpiloguePricer(CUDA).spec == TargetSpec.from_target(CUDA)


def test_emulated_plans_reach_the_stitch_pass_and_rewrites_build_for_the_cpu():
    """emulate="cuda": the stitch pass plans for the GPU; attention, which only the stitch pass could build
    without threads, is planned for the CPU it runs on (StitchTarget.kernel_spec)."""
    report = _stitched(LLVM, emulate="cuda")
    assert report.spec.family == "cuda" and report.plans and all(p.spec.family == "cuda" for p in report.plans)
    fused = [r.plan for r in report.attention if r.plan is not None]
    assert fused and all(plan.spec.family == "cpu" for plan in fused)
    assert not report.scatters  # atomic scatters are a CUDA build's
