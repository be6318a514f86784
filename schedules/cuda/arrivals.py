"""Blocks of one launch that meet: arrival counters that are zero between launches.

A kernel whose blocks write partial results and whose last blocks combine
them (split reductions, a split key range) needs to know which blocks came
last. TVM gives a kernel no zeroed memory of its own and no cooperative
launch, so the counters are a static device array of the CUDA module
(`.global`, zero when the module loads) that every protocol leaves at zero
when its launch ends: the last departure resets what it used. Kernels of one
module run one after another on the module's stream, so slots may be shared
between kernels; two launches of one module on two streams at once are not
supported.

The protocol, for `total` blocks of which the last `k` combine:

1. each block writes its partials, every thread fences them (`fence`), the
   block synchronises, one thread takes a ticket at `slot` (`ticket`: a
   fence, then an atomic increment; the old count);
2. a block whose ticket is `total - k` or more waits until all `total` have
   arrived (`await_arrivals`) and combines its share, number
   `ticket - (total - k)`; a block with a smaller ticket is done;
3. each combining block then takes a ticket at `slot + 1`; the one that gets
   `k - 1` resets both slots (`reset`).

A waiting block holds its place on an SM while the blocks it waits for may
still need one: `k` stays below the number of SMs
(planning/cuda/arrival_limits.max_combining_blocks),
so blocks that do not wait always free places. With `k = 1` nothing waits:
the last arrival sees every ticket taken.
"""

from __future__ import annotations

from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call

from tvm_stitch.planning.cuda.arrival_limits import SLOTS

FENCE, TICKET, AWAIT, RESET = range(4)  # what `tvm_stitch_arrival` does (its first argument)

# One helper: TVM's CUDA code generator writes a helper's source once per helper name, and the
# counters must be defined once per module.
_SOURCE = f"""
__forceinline__ __device__ int tvm_stitch_arrival(int what, int slot, int total) {{
    static __device__ unsigned int counters[{SLOTS}];
    int ticket = 0;
    __threadfence();
    if (what == {TICKET}) {{
        ticket = (int)atomicAdd(&counters[slot], 1u);
        __threadfence();
    }} else if (what == {AWAIT}) {{
        volatile unsigned int* count = &counters[slot];
        while (*count < (unsigned int)total) {{
        }}
        __threadfence();
    }} else if (what == {RESET}) {{
        counters[slot] = 0u;
        __threadfence();
    }}
    return ticket;
}}
"""

NAME = "tvm_stitch_arrival"



def fence() -> tirx.PrimExpr:
    """Make this thread's writes visible to every block before its block's ticket is taken (called by
    every thread of the block, which synchronises next)."""
    return _call(FENCE, 0, 0)


def ticket(slot) -> tirx.PrimExpr:
    """The count at `slot` before this arrival (int32): 0 for the first block, total - 1 for the last."""
    return _call(TICKET, slot, 0)


def await_arrivals(slot, total) -> tirx.PrimExpr:
    """Wait until `total` blocks have taken a ticket at `slot`; their writes are then visible."""
    return _call(AWAIT, slot, total)


def reset(slot) -> tirx.PrimExpr:
    """Set `slot` back to zero (by the last departure only)."""
    return _call(RESET, slot, 0)


def _call(what: int, slot, total) -> tirx.PrimExpr:
    args = [tirx.IntImm("int32", v) if isinstance(v, int) else v for v in (what, slot, total)]
    return cuda_func_call(NAME, *args, source_code=_SOURCE, return_type="int32")
