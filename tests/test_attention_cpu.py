"""The CPU attention kernel (schedules/cpu/attention.py, planning/attention.plan_cpu): register blocks
that fit the spec's vector registers, the query heads of a KV head in one task, causal query tiles
numbered from both ends, exp as a vectorised polynomial or libm's; numerics against numpy float64
on AVX-512, AVX2 and baseline x86-64 code."""

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from schedules.cpu.fast_exp import fast_exp
from tvm_stitch.rewrites.attention import kernel_for
from tvm_stitch.planning.attention import AttentionShape, plan_attention
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.target import host_target
from tvm_stitch.tools.build import build
from tvm_stitch.tools.workloads.attention import Chain

LLAMA = AttentionShape(1, 8, 4, 1024, 1024, 64, "float32", 0.125, "causal")
TARGETS = {
    "host": host_target(),
    "avx2": tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}),
    "x86-64": tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}),
}


def _spec(name: str) -> TargetSpec:
    return TargetSpec.from_target(TARGETS[name])


@pytest.mark.parametrize("target", ["host", "avx2", "x86-64"])
def test_register_blocks_fit_the_vector_registers(target):
    spec = _spec(target)
    plan = plan_attention(LLAMA, spec)
    lanes = spec.vector_bytes // 4
    for cols in (plan.score_cols, plan.out_cols):
        assert cols % lanes == 0 and plan.block_rows * cols // lanes <= spec.vector_registers // 2
    assert plan.k_tile % plan.score_cols == 0 and LLAMA.head_dim % plan.out_cols == 0
    assert plan.q_tile % plan.block_rows == 0 and plan.fast_exp


def test_query_heads_of_a_kv_head_share_one_task():
    plan = plan_attention(LLAMA, dataclasses.replace(_spec("host"), cores=2))
    assert plan.shared_heads == 2 and plan.rows == 2 * plan.q_tile
    assert plan.tasks == LLAMA.batch * LLAMA.kv_heads * plan.q_tiles >= 8
    assert f"{plan.tasks} tasks of 2 head(s) x {plan.q_tile} rows" in plan.describe()
    assert not plan_attention(LLAMA, _spec("host"), fast_exp=False).fast_exp


def test_fast_exp_matches_numpy_and_gives_zero_far_below():
    x = np.concatenate([np.linspace(-87.0, 88.0, 4093), [-3.0e38, -100.0, -np.inf]]).astype("float32")
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            a, b = T.arg("a", T.buffer((x.size,), "float32")), T.arg("b", T.buffer((x.size,), "float32"))
            with T.serial(0, x.size // 16) as i:
                with T.vectorized(0, 16) as j:
                    T.buffer_store(b, fast_exp(tvm.tirx.BufferLoad(a, [i * 16 + j])), [i * 16 + j])
    lib = tvm.tirx.build(tvm.IRModule({"main": ib.get()}), target=host_target())
    out = tvm.runtime.empty(x.shape, "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(x), out)
    got, want = out.numpy()[:-3].astype(np.float64), np.exp(x[:-3].astype(np.float64))
    assert np.abs(got / want - 1).max() < 1e-5
    assert list(out.numpy()[-3:]) == [0.0, 0.0, 0.0]


def _run(shape: AttentionShape, target: str, rng, **changes) -> float:
    """The kernel of `shape`'s CPU plan (fields replaced by `changes`) against numpy: relative error."""
    plan = dataclasses.replace(plan_attention(shape, _spec(target)), **changes)
    lib = tvm.tirx.build(tvm.IRModule({"main": kernel_for(plan).with_attr("global_symbol", "main")}),
                         target=TARGETS[target])
    chain = Chain(shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.head_dim, kv_heads=shape.kv_heads,
                  mask=shape.mask)
    arrays = chain.inputs(rng)
    if shape.mask == "additive":
        arrays[3] = arrays[3].reshape(shape.mask_shape)
    out = tvm.runtime.empty((shape.batch, shape.heads, shape.q_len, shape.head_dim), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    want = chain.reference(arrays)
    return float(np.abs(out.numpy() - want).max() / np.abs(want).max())


@pytest.mark.parametrize("target, fast", [("host", True), ("host", False), ("avx2", True), ("x86-64", True)],
                         ids=["host", "host-libm-exp", "avx2", "x86-64"])
def test_causal_gqa_query_tiles_from_both_ends_match_numpy(target, fast, rng):
    """Five query tiles of 16 rows (ragged: 72 rows), each task two query heads over one KV head, keys
    aligned at the end (kv 90 > q 72)."""
    shape = AttentionShape(1, 4, 2, 72, 90, 32, "float32", 32 ** -0.5, "causal")
    assert _run(shape, target, rng, q_tile=16, fast_exp=fast) < 1e-4


@pytest.mark.parametrize("target", ["host", "avx2"])
def test_padding_mask_and_head_dim_of_odd_vector_runs_match_numpy(target, rng):
    """A padding mask read per key tile over ragged key tiles, head dim 40 (blocks of 8 columns)."""
    shape = AttentionShape(2, 2, 2, 20, 50, 40, "float32", 40 ** -0.5, "additive", (2, 1, 1, 50), "float32")
    assert plan_attention(shape, _spec(target)).out_cols == 8
    assert _run(shape, target, rng) < 1e-4


@pytest.mark.parametrize("fast", [True, False], ids=["fast-exp", "libm-exp"])
def test_exp_is_a_polynomial_unless_fast_math_is_off(fast):
    plan = plan_attention(AttentionShape(1, 2, 2, 32, 32, 32, "float32", 0.1, "causal"), _spec("host"), fast)
    lib = tvm.tirx.build(tvm.IRModule({"main": kernel_for(plan).with_attr("global_symbol", "main")}),
                         target=host_target())
    assert (re.search(r"llvm\.exp\.|@expf", lib.inspect_source("ll")) is None) == fast


def test_pipeline_fast_math_off_plans_libm_exp(rng):
    chain = Chain(1, 2, 24, 24, 32, mask="causal")
    built = build(chain.module(), host_target(), stitched=True, fast_math=False)
    assert built.report.attention[0].plan.fast_exp is False
    arrays = chain.inputs(rng)
    got = relax.VirtualMachine(built.executable, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    want = chain.reference(arrays)
    assert np.abs(got.numpy() - want).max() / np.abs(want).max() < 1e-4
