"""Accumulating scatters on CUDA (rewrites/scatter_add.py): plans, the SIMT checker against TVM's ordered
lowering, nvcc, launch geometry and modeled time, fallbacks with their reasons."""

from __future__ import annotations

import re

import pytest
import tvm
from tvm import relax, te, topi

from conftest import CUDA, needs_nvcc, nvcc, opencl_device
from schedules.cuda.scatter_add import build as build_kernel
from tvm_stitch.pricing.kernel_geometry import kernel_geometries
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.pipeline import pipeline
from tvm_stitch.planning.reasons import PlanError
from tvm_stitch.planning.scatter_add import plan_scatter_add
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.report import StitchReport
from tvm_stitch.tools.launches import cuda_source
from tvm_stitch.tools.module_time import default_module_time, module_time
from tvm_stitch.tools.workloads.relax_blocks import function, tensor

SPEC = TargetSpec.from_target(CUDA)


def _embedding_grad(vocab: int, tokens: tuple, width: int, dtype: str = "float32", data: str = "zeros"):
    """scatter_nd(zeros (or a parameter), ids[..., None], grad, "add"): an embedding's gradient."""
    params = [tensor("ids", tokens, "int64"), tensor("grad", tokens + (width,), dtype)]
    if data == "param":
        params.append(tensor("data", (vocab, width), dtype))

    def body(bb, ids, grad, *rest):
        start = rest[0] if rest else bb.emit(relax.op.full((vocab, width), relax.const(0.0, dtype), dtype))
        return relax.op.scatter_nd(start, bb.emit(relax.op.expand_dims(ids, [-1])), grad, "add")

    return function(params, body)


def _reference(out_shape, index_shape, dtype, fill):
    """TVM's ordered scatter_nd (topi, llvm) with the kernel's signature: the indices' tuple axis last."""
    indices = te.placeholder(index_shape, "int64", name="indices")
    updates = te.placeholder(index_shape[:-1] + out_shape[index_shape[-1]:], dtype, name="updates")
    if fill is None:
        data = te.placeholder(out_shape, dtype, name="data")
        inputs = [data]
    else:
        data = te.compute(out_shape, lambda *i: tvm.tirx.const(fill, dtype), name="filled")
        inputs = []
    rank = len(index_shape)
    out = topi.scatter_nd(data, topi.transpose(indices, [rank - 1] + list(range(rank - 1))), updates, "add")
    return te.create_prim_func(inputs + [indices, updates, out])


def _simt(out_shape, index_shape, fill, oclgrind: bool, dtype: str = "float32"):
    device = opencl_device(oclgrind)
    updates_shape = index_shape[:-1] + out_shape[index_shape[-1]:]
    plan = plan_scatter_add(out_shape, index_shape, updates_shape, dtype, "int64", fill, SPEC)
    ref = _reference(out_shape, index_shape, dtype, fill)
    return check_kernel("scatter_add", build_kernel(plan), [Reference(ref, tuple(range(len(ref.params))))],
                        device, oclgrind, 0)


@pytest.mark.parametrize("out_shape,index_shape,fill", [
    ((6, 40), (3, 50, 1), 0.0),  # 150 tuples into 6 rows: every row added to many times
    ((5, 3, 8), (37, 2), None),  # two indexed axes, a copy of data, a partial last block
    ((7, 12), (9, 1), 1.5),
], ids=str)
def test_scatter_matches_the_ordered_lowering_under_simt_on_pocl(out_shape, index_shape, fill):
    result = _simt(out_shape, index_shape, fill, oclgrind=False)
    assert result.ok, result.detail
    assert result.launches == 2


def test_scatter_is_clean_under_oclgrind():
    result = _simt((6, 40), (3, 50, 1), 0.0, oclgrind=True)
    assert result.ok, result.detail


def test_symbolic_count_of_tuples_matches_under_simt_on_pocl():
    """Index tuples of a symbolic count n (a batch): one kernel for every n, run at n = 1, 37 and 128."""
    n = tvm.tirx.Var("n", "int64")
    result = _simt((6, 40), (n, 3, 1), 0.0, oclgrind=False)
    assert result.ok, result.detail
    assert len(result.sizes) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_scatter_matches_under_simt_on_pocl(dtype):
    """sm_90 adds float16 and bfloat16 atomically (the checker runs them as float32 storage rounded
    after every operation, the reference adds in the narrow type in order)."""
    result = _simt((6, 40), (3, 50, 1), 0.0, oclgrind=False, dtype=dtype)
    assert result.ok, result.detail


def test_plan_launch_and_traffic_of_an_embedding_gradient():
    plan = plan_scatter_add((30522, 768), (8, 128, 1), (8, 128, 768), "float32", "int64", 0.0, SPEC)
    assert (plan.init, plan.vector, plan.threads) == ("fill", 4, 256)
    assert plan.scatter_blocks * plan.threads == 8 * 128 * 768  # a thread per (token, element)
    assert plan.init_blocks == -(-30522 * 768 // (256 * 4))
    loaded, stored, ideal = plan.traffic()
    updates, ids, table = 8 * 128 * 768 * 4, 8 * 128 * 8, 30522 * 768 * 4
    assert ideal == updates + ids + table
    assert loaded + stored == ideal + 2 * updates  # each added element read and written at the L2 once


def test_atomic_add_is_priced_as_a_store_not_a_load():
    plan = plan_scatter_add((512, 64), (256, 1), (256, 64), "float32", "int64", 0.0, SPEC)
    fill, scatter = kernel_geometries(build_kernel(plan).with_attr("global_symbol", "s"), CUDA)
    assert fill.stores == ((16, 1),) and fill.loads == ()
    assert scatter.stores == ((4, 1),)  # the atomic add
    assert dict(scatter.loads) == {8: 1, 4: 1}  # the index (once for guard and address) and the update
    assert scatter.grid * scatter.threads == 256 * 64


def test_embedding_gradient_is_two_launches_modeled_far_below_tvms():
    mod = _embedding_grad(30522, (8, 128), 768)
    report = StitchReport()
    with CUDA:
        stitched = module_time(pipeline(CUDA, report=report)(mod), SPEC)
    default = default_module_time(mod, CUDA, SPEC)
    record, = report.scatters
    assert record.plan is not None and record.plan.init == "fill"
    assert stitched.launches == 2
    assert stitched.us * 5 < default.us, (stitched.us, default.us)
    assert min(t.launched_threads for _, _, times in stitched.kernels for t in times) >= 64 * 1024


def test_bfloat16_scatter_on_sm75_falls_back_to_tvms_lowering_with_reason():
    mod = _embedding_grad(64, (4, 8), 32, dtype="bfloat16")
    report = StitchReport()
    turing = tvm.target.Target({"kind": "cuda", "arch": "sm_75"})
    with turing:
        lowered = pipeline(turing, report=report)(mod)
    record, = report.scatters
    assert record.plan is None and record.reason.code == "scatter-dtype"
    assert "bfloat16" in record.line() and "sm_75" in record.line()
    assert not any("scatter_add" in gv.name_hint for gv in lowered.functions)


def test_symbolic_embedding_gradient_is_planned_and_priced_at_its_bound():
    batch = tvm.tirx.Var("b", "int64")
    params = [tensor("ids", (batch, 128), "int64"), tensor("grad", (batch, 128, 768), "float32")]

    def body(bb, ids, grad):
        zeros = bb.emit(relax.op.full((30522, 768), relax.const(0.0, "float32"), "float32"))
        return relax.op.scatter_nd(zeros, bb.emit(relax.op.expand_dims(ids, [-1])), grad, "add")

    mod = function(params, body)
    mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {"b": 8})
    report = StitchReport()
    with CUDA:
        pipeline(CUDA, report=report)(mod)
    record, = report.scatters
    assert record.plan.priced_at == (("b", 8),)
    assert record.plan.traffic() == plan_scatter_add((30522, 768), (8, 128, 1), (8, 128, 768), "float32", "int64",
                                                     0.0, SPEC).traffic()
    assert record.modeled_us > 0 and "b * 384 x 256 threads" in record.line()


def test_plans_refuse_what_they_cannot_add():
    with pytest.raises(PlanError) as err:
        plan_scatter_add((8, 4), (3, 1), (3, 5), "float32", "int64", 0.0, SPEC)
    assert err.value.code == "scatter-shapes"
    cpu = TargetSpec.from_target(tvm.target.Target("llvm"))
    with pytest.raises(PlanError) as err:
        plan_scatter_add((8, 4), (3, 1), (3, 4), "float32", "int64", 0.0, cpu)
    assert err.value.code == "scatter-target"
    rows = tvm.tirx.Var("v", "int64")
    with pytest.raises(PlanError) as err:
        plan_scatter_add((rows, 4), (3, 1), (3, 4), "float32", "int64", 0.0, SPEC)
    assert err.value.code == "scatter-symbolic"


def test_scatter_with_a_parameter_copies_it_in_the_kernel():
    mod = _embedding_grad(64, (4, 8), 32, data="param")
    report = StitchReport()
    with CUDA:
        ex = tvm.compile(mod, target=CUDA, relax_pipeline=pipeline(CUDA, report=report))
    record, = report.scatters
    assert record.plan.init == "copy"
    assert "tirx.cuda.atomic_add" not in cuda_source(ex) and "atomicAdd" in cuda_source(ex)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernels_compile_with_nvcc_to_atomic_adds_without_spills(dtype, tmp_path):
    mod = _embedding_grad(30522, (8, 128), 768, dtype=dtype)
    with CUDA:
        ex = tvm.compile(mod, target=CUDA, relax_pipeline=pipeline(CUDA))
    source = cuda_source(ex)
    report = nvcc(source, tmp_path, arch="sm_90")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
    ptx = (tmp_path / "kernels.ptx")
    nvcc(source, tmp_path, arch="sm_90", ptx=True)
    # an atomic add whose result no instruction reads: the thread does not wait for it
    kind = {"float32": r"global\.add\.f32", "float16": r"add\.noftz\.f16"}[dtype]
    assert re.search(rf"(atom|red)\.{kind}", ptx.read_text()), "no atomic add"
