"""Mix-order norm backward (CUDA): dx's row reductions and dgamma/dbeta's column reductions of the
same rows planned as one group: kernel 0 reads x and dy once, kernel 1 sums the column partials.

Graphs: tools/norm_backward_graphs.py (the suite's LayerNorm backward, the RMSNorm backward workload).
Numerics: the CUDA schedules built for llvm without thread bindings (emulated CUDA) against numpy,
with a random cotangent (half precision: tests/test_mix_order_half.py); modeled time against the
two-kernel plan (row-resident dx, column-split dgamma/dbeta) of the same group split as greedy
partition splits it.
"""

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_stitch.analysis.graph import analyses_for, build_graph
from tvm_stitch.kernels.outline import outline_group
from tvm_stitch.pipeline import grouping_passes
from tvm_stitch.planning.cuda.mix_order import MixOrderError, plan_mix_order
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.pricing.modeled_time import plan_times
from tvm_stitch.pricing.traffic import modeled_traffic
from schedules import schedule_for
from tvm_stitch.planning.cuda.arrival_limits import max_combining_blocks

from tvm_stitch.tools.build import build, run_cpu
from tvm_stitch.tools.norm_backward_graphs import norm_backward
from tvm_stitch.tools.workloads import reference

from conftest import CUDA, LLVM, make_module, opencl_device, tensor

SM90 = TargetSpec.from_target(CUDA)
op = relax.op


def _norm_backward(name, rows, cols, dtype):
    """The Relax module of a norm backward graph (tools/norm_backward_graphs.py) at rows x cols."""
    return norm_backward(name, dtype, rows=rows, cols=cols)[0]


def _whole_group(mod):
    """The module's stitchable bindings outlined as one fused PrimFunc (the group mix-order plans)."""
    with CUDA:
        mod = tvm.transform.Sequential(grouping_passes(CUDA))(mod)
    main = mod["main"]
    graph = build_graph(mod, main.body.blocks[0], set(relax.analysis.free_vars(main.body.body)), analyses_for(mod))
    return outline_group(mod, graph, [n.index for n in graph.nodes if n.stitchable], "mix").func


def emulated_check(name, dtype, tol, rows=264, cols=128):
    """The graph's stitched build for llvm with the CUDA schedules without thread bindings (emulated
    CUDA), run on the workload's inputs (a random cotangent dy) against numpy in float64; its plans."""
    mod, graph, dims = norm_backward(name, dtype, rows=rows, cols=cols)
    built = build(mod, LLVM, stitched=True, strict=True, emulate="cuda", fusion="search")
    inputs = graph.inputs(np.random.default_rng(0), dtype, dims)
    for out, ref in zip(run_cpu(built.executable, inputs), reference(graph, inputs)):
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(out.astype("float64") / scale, ref / scale, rtol=tol, atol=tol)
    return built.report.plans


@pytest.mark.parametrize("name", ["layernorm_backward", "rmsnorm_backward"])
def test_mix_order_matches_numpy_emulated(name):
    (plan,) = emulated_check(name, "float32", 1e-4)
    assert plan.scheme == "mix-order" and plan.kernels == (1 if plan.mapping.combining_blocks else 2), plan.notes
    assert plan.mapping.grid >= SM90.sms and plan.mapping.rows % plan.mapping.grid == 0


def test_row_or_column_reductions_alone_are_not_mix_order():
    x = tensor("x", (264, 128))
    rows = make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(x, x), axis=[-1])))
    columns = make_module([x], lambda bb, x: bb.emit(op.sum(op.multiply(x, x), axis=[0])))
    for mod in (rows, columns):
        with pytest.raises(MixOrderError):
            plan_mix_order(_whole_group(mod), SM90, "k")


def _modeled(mod, fusion):
    """(stitched plans, their modeled us in total) of the CUDA sm_90 build with the given grouping."""
    plans = build(mod, CUDA, stitched=True, strict=True, fusion=fusion).report.plans
    return plans, sum(p.modeled_us for p in plans)


@pytest.mark.parametrize("name", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("shape", [(4096, 768), (1024, 4096)])
def test_norm_backward_is_one_mix_order_launch_modeled_faster_at_bench(name, shape):
    """The fusion search takes the mix-order group at bench shapes in ONE launch (the last blocks combine
    the partials), modeled at least 1.3x faster than the two-kernel plan (row-resident dx, column-split
    dgamma/dbeta), and cheaper than its own two-launch form."""
    mod = _norm_backward(name, *shape, "float32")
    two, two_us = _modeled(mod, "greedy")
    (mixed,), mixed_us = _modeled(mod, "search")
    assert sorted(p.scheme for p in two) == ["column-split", "row-resident"]
    assert mixed.scheme == "mix-order" and mixed.kernels == 1, mixed.notes
    assert 1 <= mixed.mapping.combining_blocks <= max_combining_blocks(SM90)
    assert two_us >= 1.3 * mixed_us, (two_us, mixed_us)
    second_launch = float(re.search(r"with a second launch ([\d.]+) us", mixed.notes[0]).group(1))
    assert second_launch > mixed_us, mixed.notes


def test_combining_blocks_are_priced_after_the_others():
    """The one-launch kernel's geometry: every block's work, then the combining blocks' share (k blocks),
    not the combine in every block; the two-launch form's second kernel is gone."""
    func = _whole_group(_norm_backward("rmsnorm_backward", 1024, 4096, "float32"))
    plan = plan_mix_order(func, SM90, "k")
    k = plan.mapping.combining_blocks
    (one,) = plan_times(func, plan, SM90)
    assert [m.grid for m in one.geometry.members] == [plan.mapping.grid, k]
    combine = one.geometry.members[1]
    partial_loads = plan.mapping.grid * plan.mapping.row_elements // 4  # float4 loads of the partials
    assert sum(c for w, c in combine.loads if w == 16) * combine.threads * k == partial_loads
    two = dataclasses.replace(plan, kernels=2, mapping=dataclasses.replace(plan.mapping, combining_blocks=0))
    assert len(plan_times(func, two, SM90)) == 2
    # the same bytes move in one launch as in two (the moved combine's accesses recorded for the model)
    traffic = [modeled_traffic(schedule_for(func, p, CUDA).mod["main"], SM90) for p in (plan, two)]
    assert traffic[0] == traffic[1], traffic


# Oclgrind simulates the one launch (264 x 128) in 7-11 minutes here: slow tier.
@pytest.mark.parametrize("oclgrind", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["pocl", "oclgrind"])
def test_mix_order_is_clean_under_simt(oclgrind):
    """The one launch with SIMT semantics: the all-reduces of each row, the register partials written once
    per block, the last block's combine (checked with one combining block: simt/last_block), run twice
    (the arrival counters back at zero); against numpy on the CPU (races and bounds: Oclgrind)."""
    pytest.importorskip("pyopencl")
    from tvm_stitch import simt
    opencl_device(oclgrind)
    report = simt.check(_norm_backward("layernorm_backward", 264, 128, "float32"), oclgrind=oclgrind)
    assert report.ok, str(report)
    assert [p.scheme for p in report.stitch.plans] == ["mix-order"], str(report)
    (plan,) = report.stitch.plans
    assert plan.mapping.combining_blocks > 0, plan.notes
    assert [k.launches for k in report.kernels] == [1], str(report)  # the combine in the same launch
    for kernel in report.kernels:
        assert kernel.max_error < 0.05, kernel
