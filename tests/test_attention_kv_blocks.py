"""The tensor-core attention kernel with its key range split across blocks of one launch (plan.kv_blocks):
chosen by the time model for the cross-attention of 128 queries and never at the self-attention shapes,
the chunks' partials combined by the last block of each query tile (arrival counters), matching the unfused
computation under the SIMT checker with the counters back at zero, and compiling without spills."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

from conftest import needs_nvcc, nvcc, opencl_device
from attention_reference import reference_func
from schedules.cuda import attention_kv_blocks as kv_schedule
from tvm_stitch.planning import attention_kv_blocks, attention_mma
from tvm_stitch.planning.attention import AttentionPlan, AttentionShape, plan_attention
from tvm_stitch.planning.attention_cost import geometry, modeled_us, traffic
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.rewrites.attention import kernel_for
from tvm_stitch.simt import opencl_run
from tvm_stitch.simt.opencl_build import build_opencl
from tvm_stitch.simt.simt_kernel import Reference, check_kernel
from tvm_stitch.tools.launches import cuda_source

SM90 = TargetSpec.from_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
HALF = ("float16", "bfloat16")


def _shape(batch, heads, q_len, kv_len, head_dim, dtype, kv_heads=None, mask="none", priced_at=()):
    mask_shape = (batch, 1, 1, kv_len) if mask == "additive" else ()
    return AttentionShape(batch, heads, kv_heads or heads, q_len, kv_len, head_dim, dtype, head_dim ** -0.5, mask,
                          mask_shape, "float32" if mask_shape else "", priced_at=priced_at)


def _plan(shape, q_tile, kv_splits, warp_keys, kv_blocks):
    return AttentionPlan(shape, SM90, q_tile=q_tile, k_tile=kv_splits * warp_keys, mma=True, kv_splits=kv_splits,
                         kv_blocks=kv_blocks)


def _tflops(shape, us) -> float:
    return 4.0 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim / us / 1e6


SELF = {
    "plain": _shape(2, 16, 1024, 1024, 64, "float16"),
    "padding": _shape(8, 12, 512, 512, 64, "bfloat16", mask="additive"),
    "causal-gqa": _shape(1, 32, 2048, 2048, 128, "float16", kv_heads=8, mask="causal"),
}


@pytest.mark.parametrize("dtype", HALF)
def test_cross_attention_splits_its_key_range_across_blocks_modeled_faster(dtype):
    shape = _shape(1, 12, 128, 2048, 64, dtype)
    plan = plan_attention(shape, SM90)
    one_block = min(modeled_us(p) for p in attention_mma.candidates(shape, SM90, AttentionPlan))
    assert plan.mma and plan.kv_blocks > 1 and plan.tasks == 12 * plan.q_tiles * plan.kv_blocks
    assert "combined by the last to arrive" in plan.describe()
    assert modeled_us(plan) < 0.7 * one_block  # 10.1 us against 15.8 (8 warps of 16 keys, one block a tile)
    assert 75 <= _tflops(shape, modeled_us(plan)) <= 900


@pytest.mark.parametrize("case", sorted(SELF))
def test_self_attention_shapes_keep_one_block_per_query_tile_and_their_time(case):
    shape = SELF[case]
    plan = plan_attention(shape, SM90)
    assert plan.kv_blocks == 1
    assert modeled_us(plan) == min(modeled_us(p) for p in attention_mma.candidates(shape, SM90, AttentionPlan))


def test_the_split_is_priced_with_its_workspace_and_combine():
    """The chunks' partials are written and read once; the combine is a second part of the launch, one block
    per query tile, its threads reading every chunk's max and sum and share of their row."""
    shape = _shape(1, 12, 128, 2048, 64, "float16")
    plan = _plan(shape, 16, 8, 16, 4)
    unsplit = dataclasses.replace(plan, kv_blocks=1)
    workspace = 4 * 12 * 8 * 4 * 16 * (64 + 2)  # tiles x chunks x rows x (output columns, max and sum)
    assert attention_kv_blocks.workspace_bytes(plan) == workspace
    assert sum(traffic(plan)[:2]) == sum(traffic(unsplit)[:2]) + 2 * workspace
    chunks, combine = geometry(plan).members
    assert (chunks.grid, combine.grid) == (12 * 8 * 4, 12 * 8)
    assert chunks.load_phases == 16 // 4 + 2  # Q, a chunk's 4 key tiles, the ticket
    assert combine.loads == ((8, 4), (16, 4))  # 256 threads over 16 rows: per chunk (max, sum), 4 columns


def test_splits_are_offered_only_where_each_chunk_has_key_tiles_and_a_counter():
    cross = _plan(_shape(1, 12, 128, 2048, 64, "float16"), 16, 8, 16, 1)  # 16 key tiles
    assert attention_kv_blocks.offered(cross, 16) and not attention_kv_blocks.offered(cross, 32)
    assert not attention_kv_blocks.offered(_plan(_shape(1, 1, 16, 200, 64, "float16"), 16, 1, 64, 1), 3)  # 2+2+0
    causal = _plan(SELF["causal-gqa"], 64, 1, 32, 1)
    assert not attention_kv_blocks.offered(causal, 2)
    n = tirx.Var("n", "int64")
    symbolic = _plan(_shape(1, 12, n, 2048, 64, "float16", priced_at=(("n", 128),)), 16, 8, 16, 1)
    assert not attention_kv_blocks.offered(symbolic, 2)
    slots = kv_schedule.arrivals.SLOTS
    at_most = _plan(_shape(1, slots // 8, 128, 2048, 64, "float16"), 16, 8, 16, 1)
    assert attention_kv_blocks.tiles(at_most) == slots and attention_kv_blocks.offered(at_most, 2)
    over = _plan(_shape(2, slots // 8, 128, 2048, 64, "float16"), 16, 8, 16, 1)
    assert attention_kv_blocks.tiles(over) == 2 * slots and not attention_kv_blocks.offered(over, 2)


def _check(plan, oclgrind=False):
    ref = reference_func(plan.shape)
    return check_kernel("fused_attention", kernel_for(plan), [Reference(ref, tuple(range(len(ref.params))))],
                        opencl_device(oclgrind), oclgrind, 0, [{}])


@pytest.mark.parametrize("dtype, split", [("float16", (1, 32)), ("bfloat16", (2, 16))], ids=["1x32", "2x16"])
def test_key_chunks_combined_by_the_last_block_match_on_pocl(dtype, split):
    """16 queries x 200 keys: 7 key tiles of 32 in 4 chunks (2, 2, 2, 1), the last tile ragged; run twice
    on new buffers by the checker (the counters must be back at zero)."""
    check = _check(_plan(_shape(1, 1, 16, 200, 64, dtype), 16, *split, 4))
    assert check.ok and "emulated lane by lane" in check.detail, check


@pytest.mark.slow
def test_key_chunks_with_padding_mask_over_heads_and_row_groups_match_on_pocl():
    """Two (batch, head)s x 2 query tiles of 32 rows (ragged), a padding mask, 2 warps x 16 keys, 2 chunks."""
    check = _check(_plan(_shape(2, 1, 50, 100, 64, "float16", mask="additive"), 32, 2, 16, 2))
    assert check.ok, check


def test_key_chunks_over_grouped_kv_heads_match_on_pocl():
    """4 query heads over 2 KV heads, head dim 32: 7 key tiles of 16 in chunks of 3, 3 and 1 (4 tiles, 4
    counters at once)."""
    check = _check(_plan(_shape(1, 4, 16, 100, 32, "float16", kv_heads=2), 16, 1, 16, 3))
    assert check.ok, check


def test_counters_left_set_fail_the_check(monkeypatch):
    monkeypatch.setattr(kv_schedule.arrivals, "reset", lambda slot: tirx.const(0, "int32"))
    check = _check(_plan(_shape(1, 1, 16, 200, 64, "float16"), 16, 1, 32, 4))
    assert not check.ok and "arrival counters" in check.detail, check


def _wait_after_reset():
    """2 blocks of 2 threads; in the last block thread 0 resets the counter, then every thread waits."""
    arrivals = kv_schedule.arrivals

    @T.prim_func
    def waits(x: T.Buffer((2, 2), "float32"), out: T.Buffer((2, 2), "float32")):
        T.func_attr({"tirx.noalias": True, "global_symbol": "waits", "tirx.is_scheduled": True})
        for b in T.thread_binding(2, thread="blockIdx.x"):
            turn = T.decl_buffer((1,), "int32", scope="shared")
            for t in T.thread_binding(2, thread="threadIdx.x"):
                mine = T.decl_buffer((1,), "int32", scope="local")
                T.evaluate(arrivals.fence())
                T.tvm_storage_sync("shared")
                if t == 0:
                    turn[0] = arrivals.ticket(0)
                T.tvm_storage_sync("shared")
                mine[0] = turn[0]
                if mine[0] == 1:
                    if t == 0:
                        T.evaluate(arrivals.reset(0))
                    T.evaluate(arrivals.await_arrivals(0, 2))
                out[b, t] = T.if_then_else(mine[0] == 1, x[b, t] + T.float32(1), x[b, t])

    return waits


def test_a_thread_waiting_after_the_reset_is_reported():
    """The order the combining block must avoid (its thread 0 alone waits and resets): pocl runs a group's
    threads in turn, so thread 1 reads the reset counter and its wait gives up (a GPU would hang) and
    leaves the counter set: the second run's tickets, and so its outputs, differ."""
    x = np.arange(4, dtype="float32").reshape(2, 2)
    specs = [("x", "float32", (2, 2)), ("out", "float32", (2, 2))]
    result = opencl_run.run(build_opencl(_wait_after_reset(), "waits"), specs, {0: x}, opencl_device(False), False)
    assert any("arrival counters" in problem for problem in result.guard_problems), result.guard_problems


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF)
def test_key_chunks_are_clean_under_oclgrind(dtype):
    """Oclgrind runs a work-group's threads one after another: a thread reading the counter after thread 0
    reset it would spin here."""
    check = _check(_plan(_shape(1, 1, 16, 40, 16, dtype), 16, 1, 16, 2), oclgrind=True)
    assert check.ok, check


@needs_nvcc
@pytest.mark.parametrize("dtype", HALF)
def test_the_planned_cross_kernel_compiles_without_spills_on_sm80_and_sm90(dtype, tmp_path):
    plan = plan_attention(_shape(1, 12, 128, 2048, 64, dtype), SM90)
    assert plan.kv_blocks > 1
    lib = tvm.compile(tvm.IRModule({"main": kernel_for(plan).with_attr("global_symbol", "main")}),
                      target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm"))
    source = cuda_source(lib)
    ptx = "f16" if dtype == "float16" else "bf16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in source and "atomicAdd(&counters" in source
    for arch in ("sm_80", "sm_90"):
        report = nvcc(source, tmp_path, arch=arch)
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
