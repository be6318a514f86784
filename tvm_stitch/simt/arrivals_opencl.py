"""The arrival counters of schedules/cuda/arrivals in OpenCL: same protocol, checked on pocl and Oclgrind.

The CUDA helper `tvm_stitch_arrival(what, slot, total)` becomes an external
call of an OpenCL function of the same name over a program-scope counter
array (OpenCL C 2.0: zero when the program is built, kept between launches
of the built program), with OpenCL 1.2's atomics and fences. A fence is
called by every thread of a block and the block synchronises after it; in
OpenCL it is a barrier over global memory as well (the block's CUDA
synchronisation orders global memory, OpenCL's local barrier does not).

A wait cannot spin forever where the OpenCL device runs fewer work-groups
at once than wait: it gives up after `POLLS` reads, and the combine that
follows it then reads partials not yet written (a mismatch). The checked
plans combine in the last block only (nothing to wait for).

Oclgrind's race detector knows no synchronisation between work-groups: a
store before a block's ticket and the last block's load after its own is
reported as a race although the fence and the atomic ticket order them.
`without_ordered_races` takes out of its log the races between two groups'
accesses of which one comes before the program's first ticket and the other
after a wait for all arrivals that follows it: the order the protocol
makes. A read after the ticket that no wait precedes, a race within a
group, and every other race stay.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx

from schedules.cuda.arrivals import AWAIT, FENCE, NAME, RESET, SLOTS, TICKET

POLLS = 1 << 22
BUILD_OPTIONS = ("-cl-std=CL2.0",)  # program-scope variables

HELPER = f"""
global uint tvm_stitch_counters[{SLOTS}];

int {NAME}(int what, int slot, int total) {{
  int ticket = 0;
  if (what == {FENCE}) {{
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
  }}
  mem_fence(CLK_GLOBAL_MEM_FENCE);
  if (what == {TICKET}) {{
    ticket = (int)atomic_inc(&tvm_stitch_counters[slot]);
  }} else if (what == {AWAIT}) {{
    for (int poll = 0; poll < {POLLS} && atomic_or(&tvm_stitch_counters[slot], 0u) < (uint)total; ++poll) {{
    }}
  }} else if (what == {RESET}) {{
    atomic_xchg(&tvm_stitch_counters[slot], 0u);
  }}
  mem_fence(CLK_GLOBAL_MEM_FENCE);
  return ticket;
}}
"""

_TICKET_CALL = re.compile(rf"\b{NAME}\({TICKET},")
_AWAIT_CALL = re.compile(rf"\b{NAME}\({AWAIT},")
_ENTITY = re.compile(r"entity:.*Group\((\d+),(\d+),(\d+)\)")
_LINE = re.compile(r"At line (\d+)")
_REPORT = re.compile(r"\n\n+")  # Oclgrind separates reports by empty lines (lines inside one hold a tab)


def arrivals_as_extern_calls(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each CUDA arrival helper call as an external call of the OpenCL function."""
    def extern(e):
        if (isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "tirx.cuda.func_call"
                and e.args[0].value == NAME):
            return tirx.call_extern("int32", NAME, *e.args[1:-1])
        return e

    return tvm_ffi.structural_map(func, [(tvm.ir.Expr, extern)], order="post")


def uses_arrivals(source: str) -> bool:
    return f"{NAME}(" in source


def with_helper(source: str) -> str:
    if not uses_arrivals(source):
        return source
    macros, source = _vector_accesses(source)
    return HELPER + macros + source


_VECTOR_CALL = re.compile(r"\b(vload|vstore)(2|4|8|16)\(")
_SCALARS = ("float", "half", "int", "uint", "long", "ulong", "short", "ushort", "char", "uchar", "double")
_DECLARED = re.compile(rf"\b({'|'.join(_SCALARS)})\*?\s+(?:restrict\s+)?(\w+)")


def _vector_accesses(source: str) -> tuple:
    """(macros, source with each vloadN/vstoreN call naming its macro): pocl under -cl-std=CL2.0
    declares vloadN/vstoreN for the generic address space only, which a device without it does not
    match. Macros by element type (that of the pointer's declared name) expand where they are called,
    so Oclgrind reports an access at its own line (without_ordered_races)."""
    types = {name: scalar for scalar, name in _DECLARED.findall(source)}
    used, out, last = set(), [], 0
    for match in _VECTOR_CALL.finditer(source):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        pointer = re.search(r"\w+", source[match.end():end].rsplit(",", 1)[-1].strip().lstrip("(")).group(0)
        scalar = types.get(pointer)
        if scalar is None:
            continue
        kind, n = match.group(1), int(match.group(2))
        used.add((kind, n, scalar))
        out.append(source[last:match.start()] + f"tvm_stitch_{kind}{n}_{scalar}(")
        last = match.end()
    macros = []
    for kind, n, scalar in sorted(used):
        if kind == "vload":
            parts = ", ".join(f"(p)[(o) * {n} + {i}]" for i in range(n))
            macros.append(f"#define tvm_stitch_vload{n}_{scalar}(o, p) (({scalar}{n})({parts}))")
        else:
            stores = " ".join(f"(p)[(o) * {n} + {i}] = v_.s{i:x};" for i in range(n))
            macros.append(f"#define tvm_stitch_vstore{n}_{scalar}(v, o, p) {{ {scalar}{n} v_ = (v); {stores} }}")
    return "".join(m + "\n" for m in macros), "".join(out) + source[last:]


def without_ordered_races(log: str, source: str) -> str:
    """Oclgrind's `log` without the races the arrival protocol orders (see the module)."""
    tickets, waits = (_lines(source, call) for call in (_TICKET_CALL, _AWAIT_CALL))
    if not tickets:
        return log
    return "\n\n".join(r for r in _REPORT.split(log) if not _ordered(r, tickets[0], waits))


def _lines(source: str, call) -> list:
    return [source.count("\n", 0, m.start()) + 1 for m in call.finditer(source)]


def _ordered(report: str, ticket_line: int, waits: list) -> bool:
    if "data race" not in report.strip().split("\n", 1)[0]:
        return False
    groups = [tuple(int(g) for g in reversed(m.groups())) for m in _ENTITY.finditer(report)]
    lines = [int(n) for n in _LINE.findall(report)]
    if len(groups) != 2 or len(lines) != 2:
        return False
    (before, first), (after, second) = sorted(zip(lines, groups))
    return before < ticket_line and any(ticket_line < w < after for w in waits) and first != second
