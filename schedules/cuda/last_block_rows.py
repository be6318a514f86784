"""A two-phase row-split plan in one launch: phase 1 of each row runs in the row's last block to arrive.

The row-split schedule (schedules/cuda/row_split) makes one kernel per phase:
phase 0's blocks (rows x split) write their chunk's partials, phase 1
combines a row's partials in every block of the row and goes on with its
chunk. With the plan's `last_block_rows` (planning/cuda/last_block_rows), the
two phases share one launch behind the arrival counters
(schedules/cuda/arrivals):

- every block, its phase-0 partials written, fences, takes a ticket at its
  row's slot;
- the block that takes the row's last ticket (split - 1) waits for the
  row's arrivals (all taken: nothing to wait for; it orders the partials'
  reads after their writes), runs phase 1 over the whole row (phase 1's
  chunk loops walk the chunks in turn) and resets the slot; the other
  blocks are done.

No block ever waits for a block that has not arrived, so any number of
blocks per row and any order of starting blocks is safe. Phase 1 is marked
with COMBINING_ATTR (one block per row): the geometry reader prices it as
`rows` blocks that run after the others (pricing/kernel_geometry). Partials
stay workspace the host allocates. A chain of three phases keeps its
launches: its phase 1 holds cross-thread reductions, whose barriers would
sit in loops under the last block's branch, which pocl does not run
correctly (Oclgrind does), so the SIMT checker could not vouch for it.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from tvm_stitch.planning.plan import StitchPlan

from . import arrivals
from .combine_in_launch import COMBINING_ATTR

PLACE = 1 << 20  # the template's marker of a phase's place (plus the phase)


class LastBlockShapeError(ValueError):
    """The scheduled phases are not the shape this rewrite joins (the plan keeps its launches)."""


def _phase_loops(body) -> list:
    """The root's loops bound to blockIdx.y (one row loop per phase), in order."""
    stmts = body.seq if isinstance(body, tirx.SeqStmt) else [body]
    loops = [s for s in stmts if isinstance(s, tirx.For) and s.thread_binding is not None
             and s.thread_binding.thread_tag == "blockIdx.y"]
    if len(loops) != len(stmts):
        raise LastBlockShapeError("phases are not row loops bound to blockIdx.y")
    return loops


def _template(row: tirx.Var, rows: int, threads: int, split: int) -> tirx.Stmt:
    """The row loop's body: phase 0 (`T.evaluate(PLACE)`), the ticket, then in the last block phase 1
    (`T.evaluate(PLACE + 1)`) and the slot reset."""
    lines = [
        "@T.prim_func",
        "def row():",
        "    turn = T.decl_buffer((1,), 'int32', scope='shared')",
        "    last = T.decl_buffer((1,), 'int32', scope='local')",
        f"    T.evaluate({PLACE})",
        f"    for t in T.thread_binding({threads}, thread='threadIdx.x'):",
        "        T.evaluate(arrivals.fence())",
        "        T.tvm_storage_sync('shared')",
        "        if t == 0:",
        "            turn[0] = arrivals.ticket(r)",
        "        T.tvm_storage_sync('shared')",
        "        last[0] = turn[0]",
        f"    with T.attr(0, '{COMBINING_ATTR}', {rows}):",
        f"        if last[0] == {split - 1}:",
        f"            for t in T.thread_binding({threads}, thread='threadIdx.x'):",
        "                if t == 0:",
        f"                    T.evaluate(arrivals.await_arrivals(r, {split}))",
        "                T.tvm_storage_sync('shared')",
    ]
    lines += [
        f"            T.evaluate({PLACE + 1})",
        f"            for t in T.thread_binding({threads}, thread='threadIdx.x'):",
        "                if t == 0:",
        "                    T.evaluate(arrivals.reset(r))",
    ]
    # `r` is the row loop's variable, bound where the body is placed (finish_in_last_block)
    func = tvm.script.from_source("\n".join(lines) + "\n", extra_vars={"T": T, "arrivals": arrivals, "r": row},
                                  check_well_formed=False)
    return func.body


def _whole_row(phase, row: tirx.Var):
    """Phase 1's row body at the row variable `row`, its chunk loops (blockIdx.x) serial."""
    def serial(loop):
        if loop.thread_binding is not None and loop.thread_binding.thread_tag == "blockIdx.x":
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body, None,
                            loop.annotations)
        return loop

    body = tvm_ffi.structural_map(phase.body, (tirx.For, serial), order="post")
    return tvm_ffi.structural_map(body, (tirx.Var, lambda v: row if v.same_as(phase.loop_var) else v))


def finish_in_last_block(func: tirx.PrimFunc, plan: StitchPlan) -> tirx.PrimFunc:
    """`func` (the row-split schedule's two phases, bound for CUDA) as one launch whose phase 1 each row's
    last block runs; LastBlockShapeError where its shape is not the one this rewrite knows."""
    m = plan.mapping
    root = func.body.block
    phases = _phase_loops(root.body)
    if len(phases) != 2 or any(int(p.extent) != m.rows for p in phases):
        raise LastBlockShapeError(f"{len(phases)} row loops of {m.rows} rows")
    first, second = phases
    placed = {PLACE: first.body, PLACE + 1: _whole_row(second, first.loop_var)}

    def fill(stmt):
        if isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tirx.IntImm) and stmt.value.value in placed:
            return placed[stmt.value.value]
        return stmt

    body = tvm_ffi.structural_map(_template(first.loop_var, m.rows, m.threads, m.split),
                                  (tirx.Evaluate, fill), order="post")
    kernel = tirx.For(first.loop_var, first.min, first.extent, first.kind, body, first.thread_binding,
                      first.annotations)
    # Buffers the phases pass on stay allocated outside the kernel (workspace the host allocates): placed
    # by TVM at the common scope of their uses, now one kernel, they would be a global allocation in
    # device code, which CUDA cannot make.
    passed = [a for a in root.alloc_buffers if str(a.scope()) == "global"]
    stmts = [tirx.AllocBuffer(a) for a in passed] + [kernel]
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, tirx.SeqStmt(stmts), root.init,
                         [a for a in root.alloc_buffers if not any(a.same_as(p) for p in passed)],
                         root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, block))
