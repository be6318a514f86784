"""The public API: pipeline, StitchFusion, explain, plans; clear errors for bad input."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_stitch
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.tools.workloads import SUITE, dims, reference

from conftest import CUDA, LLVM

GRAPH = SUITE["layernorm_softmax"]


def _mod():
    return GRAPH.build("float32", dims("test"))


def _check_against_numpy(ex):
    """The build's output is the numpy reference's (random gamma and beta: a wrong LayerNorm shows)."""
    inputs = GRAPH.inputs(np.random.default_rng(0), "float32", dims("test"))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()
    np.testing.assert_allclose(out, reference(GRAPH, inputs)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", [{"kind": "llvm"}, {"kind": "cuda", "arch": "sm_90"}, "llvm"])
def test_pipeline_is_a_drop_in_relax_pipeline(target):
    report = tvm_stitch.StitchReport()
    target = tvm.target.Target(target)
    ex = tvm.compile(_mod(), target=target, relax_pipeline=tvm_stitch.pipeline(target, report=report))
    (plan,) = report.plans
    assert plan.spec == tvm_stitch.TargetSpec.from_target(target)
    if target.kind.name == "cuda":
        assert f"{plan.kernel}_kernel" in cuda_source(ex)
    else:
        _check_against_numpy(ex)


def test_pipeline_runs_on_cpu():
    ex = tvm.compile(_mod(), target=LLVM, relax_pipeline=tvm_stitch.pipeline(LLVM))
    _check_against_numpy(ex)


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


@pytest.mark.parametrize("arch, sms", [("sm_80", 108), ("sm_86", 84), ("sm_89", 128), ("sm_90", 132),
                                       ("sm_90a", 132)])
def test_target_spec_reads_the_sm_count_of_the_arch(arch, sms):
    spec = tvm_stitch.TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": arch}))
    assert (spec.family, spec.arch, spec.sms) == ("cuda", arch, sms)
    assert spec.shared_bytes_per_block == 48 * 1024 and spec.warp_size == 32


def test_target_attributes_win_over_the_arch_table():
    a100 = tvm_stitch.TargetSpec.from_target(tvm.target.Target("nvidia/nvidia-a100"))
    assert (a100.sms, a100.cache_bytes) == (108, 41943040)
    small = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 16384,
                               "max_threads_per_block": 128})
    spec = tvm_stitch.TargetSpec.from_target(small)
    assert (spec.shared_bytes_per_block, spec.max_threads_per_block) == (16384, 128)
    (plan,) = tvm_stitch.explain(_mod(), small).plans
    assert plan.spec == spec and plan.threads_per_block <= 128 and plan.shared_bytes <= 16384


def test_cpu_spec_reads_the_runtime_threads_and_the_vector_width():
    spec = tvm_stitch.TargetSpec.from_target(LLVM)
    assert spec.family == "cpu" and spec.cores == tvm.get_global_func("runtime.NumThreads")()
    assert spec.vector_bytes == 16  # no mcpu: the ISA's baseline (x86-64 SSE2, Arm NEON), 128 bits
    with pytest.raises(ValueError, match="no TargetSpec"):
        tvm_stitch.TargetSpec.from_target(tvm.target.Target("c"))


def test_explain_prints_the_spec_every_plan_was_made_for():
    report = tvm_stitch.explain(_mod(), {"kind": "cuda", "arch": "sm_80"})
    assert all(p.spec.sms == 108 for p in report.plans) and report.plans
    assert report.table().startswith("plans made for cuda sm_80: 108 SMs")
    assert "plans made for cuda sm_80" in report.details()


def test_emulate_plans_for_sm90_unless_given_a_gpu():
    mod = _mod()
    default, a100 = tvm_stitch.StitchReport(), tvm_stitch.StitchReport()
    grouped = relax.transform.FuseOps()(relax.transform.LegalizeOps()(mod))
    tvm_stitch.StitchFusion(LLVM, report=default, emulate="cuda")(grouped)
    tvm_stitch.StitchFusion(LLVM, report=a100, emulate={"kind": "cuda", "arch": "sm_80"})(grouped)
    assert {p.spec.arch for p in default.plans} == {"sm_90"}
    assert {p.spec.sms for p in a100.plans} == {108}
    with pytest.raises(ValueError, match="emulate"):
        tvm_stitch.StitchFusion(LLVM, emulate="llvm")
    with pytest.raises(ValueError, match="spec is for cpu"):
        tvm_stitch.StitchFusion(CUDA, spec=tvm_stitch.TargetSpec.from_target(LLVM))(grouped)


def test_compiling_imports_no_tooling_module():
    """The compiler core never imports tvm_stitch.tools (checked in a fresh interpreter)."""
    code = """
import sys, tvm, tvm_stitch
from tvm import relax
x = relax.Var("x", relax.TensorType((8, 64), "float32"))
bb = relax.BlockBuilder()
with bb.function("main", [x]):
    with bb.dataflow():
        e = bb.emit(relax.op.exp(relax.op.subtract(x, relax.op.max(x, axis=[-1], keepdims=True))))
        out = bb.emit_output(relax.op.divide(e, relax.op.sum(e, axis=[-1], keepdims=True)))
    bb.emit_func_output(out)
report = tvm_stitch.StitchReport()
for target in (tvm.target.Target("llvm"), tvm.target.Target({"kind": "cuda", "arch": "sm_90"})):
    tvm.compile(bb.get(), target=target, relax_pipeline=tvm_stitch.pipeline(target, report=report))
assert len(report.plans) == 2, report
print(sorted(m for m in sys.modules if m.startswith("tvm_stitch.tools")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _imports(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import name`: name may be a module of pkg (`from tvm_stitch.check import x`)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "schedules":
        return "schedules"
    return parts[1] if len(parts) > 2 and parts[0] == "tvm_stitch" else "top"


def test_the_flow_is_one_way():
    """No import cycle between the core's packages; planning uses neither schedules nor the later
    steps; nothing in the core imports the tools."""
    root = Path(tvm_stitch.__file__).parent
    files = {f"tvm_stitch.{p.parent.name}.{p.stem}" if p.parent != root else f"tvm_stitch.{p.stem}": p
             for p in list(root.glob("*.py")) + list(root.glob("*/*.py"))
             if p.parent.name != "tools" and p.stem != "__main__"}  # `python -m tvm_stitch` is the CLI
    files.update({".".join(p.relative_to(root.parent).with_suffix("").parts): p
                  for p in (root.parent / "schedules").rglob("*.py")})
    edges = {}
    for module, path in files.items():
        imported = _imports(path)
        assert not [m for m in imported if m.startswith("tvm_stitch.tools")], module
        for other in imported:
            if other.startswith(("tvm_stitch.", "schedules")) and _package(other) != _package(module):
                edges.setdefault(_package(module), set()).add(_package(other))
    assert not edges.get("planning", set()) & {"schedules", "rewrites", "grouping", "kernels", "pricing", "stitch", "simt",
                                            "top"}, edges["planning"]

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in edges.get(start, ()))

    assert not [p for p in edges if p != "top" and reaches(p, p)], edges
