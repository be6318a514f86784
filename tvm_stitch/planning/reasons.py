"""Why a group is not stitched: a code with parameters, rendered to prose here and only here.

A planner raises PlanError (or a subclass: SplitError, SharedMemoryError)
with a code of `MESSAGES` and the code's parameters; the stitch pass keeps
the `Reason` of a group that falls back, and the report prints its `text`.
An error that is not a PlanError (TVM refusing a schedule, a build failing)
becomes the reason `error`, with the exception's type and last line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType


def _work(elements) -> str:
    return "an unbounded number of elements" if elements is None else f"{elements} elements"


def _rows_end(rank: int, limit: str) -> str:
    return f" (rows end at axis {rank}: {limit})" if limit else ""


def _idle_grid(p: dict, rows: str) -> str:
    return (f"{rows}: {p['blocks']} blocks, {p['threads']} threads launched where one wave holds "
            f"{p['resident']}; {p['candidates']} candidate plans for the time model; row-split: {p['split']}")


# code -> the prose of its parameters
MESSAGES = MappingProxyType({
    # what every scheme needs of a block
    "no-blocks": lambda p: "no blocks",
    "loop-nest": lambda p: f"block {p['block']}: loop nest is not one loop per iterator",
    "region-access": lambda p: (f"block {p['block']} {p['role']} a region of {p['buffer']} that no element "
                                "access of its body describes"),
    "not-inlinable": lambda p: f"block {p['block']} cannot be inlined: {p['detail']}",
    # row-resident
    "rank-outside-depth": lambda p: f"rank {p['rank']} is outside the aligned depth 1..{p['depth']}",
    "no-row-axis": lambda p: (f"no row axis shared by all blocks ({p['limit']}), and one row task "
                              f"cannot hold {_work(p['elements'])}"),
    "shared-memory-exceeded": lambda p: (f"{p['bytes']} bytes of shared memory per row (intermediates, cached "
                                         f"inputs, reduction staging) exceed {p['limit']} of shared memory"),
    "symbolic-shared-buffer": lambda p: (f"{', '.join(p['blocks'])}: a row of symbolic length cannot have a "
                                         f"static shared buffer{_rows_end(p['rank'], p['limit'])}"),
    "bound-keeps-nothing": lambda p: f"nothing of a row of {p['elements']} elements is kept on chip",
    "no-scheme": lambda p: f"{p['row_resident'].text}; and no row-split plan: {p['row_split'].text}",
    # row-split
    "split-cuda-only": lambda p: "row-split is a CUDA scheme",
    "split-writes-several": lambda p: f"block {p['block']} writes several buffers",
    "split-no-row-axis": lambda p: "no row axis shared by all blocks",
    "split-symbolic-rows": lambda p: "symbolic row count",
    "split-symbolic-length": lambda p: f"block {p['block']}: symbolic extent inside a row",
    "split-reduction-outputs": lambda p: f"block {p['block']}: reduction with {p['outputs']} outputs per row",
    "split-lengths-differ": lambda p: "blocks differ in row length",
    "split-enough-columns": lambda p: f"{p['rows']} column walks of {p['length']}: enough blocks without a split",
    "split-resident-fits": lambda p: f"{p['rows']} rows of {p['length']} elements: row-resident fits",
    "split-too-many-kernels": lambda p: f"{p['kernels']} kernels: launches would cost more than idle SMs",
    "split-not-starved": lambda p: (f"{p['blocks']} blocks without a split: not starved enough to pay a launch "
                                    "that only combines"),
    "split-not-whole-chunks": lambda p: f"{p['split']} chunks of a row of {p['length']}: not whole chunks of the least length",
    # column-split
    "column-spatial-inside": lambda p: f"block {p['block']}: spatial iterators inside reduced ones",
    "column-symbolic": lambda p: f"block {p['block']}: symbolic extents",
    "column-read-across": lambda p: f"block {p['block']} reads {p['buffer']} along a reduced or outer axis",
    "column-no-reduction": lambda p: "no reduction",
    "column-shapes-differ": lambda p: "reductions of different shapes",
    "column-whole-tensor-small": lambda p: f"a whole-tensor reduction of {p['elements']} elements: one block holds it",
    "column-writes-several": lambda p: f"block {p['block']} writes several buffers",
    "column-not-epilogue": lambda p: f"block {p['block']} is not an element-wise epilogue of one reduction",
    "column-cuda-only": lambda p: "column-split is a CUDA scheme",
    "column-no-row-divisor": lambda p: f"{p['rows']} rows have no divisor that gives a warp of threads per column tile",
    "column-no-chunks": lambda p: f"{p['elements']} elements: no split into 2..{p['most']} chunks",
    # mix-order (planning/cuda/mix_order.py)
    "mix-not-two-orders": lambda p: "not row reductions and column reductions of the same rows",
    "mix-block-shape": lambda p: f"block {p['block']} is neither over the rows nor a column reduction of them",
    "mix-symbolic": lambda p: f"block {p['block']}: symbolic extents",
    "mix-columns-indivisible": lambda p: f"{p['columns']} columns: no warp-multiple of threads times {p['vector']} lanes divides them",
    "mix-no-chunks": lambda p: f"{p['rows']} rows: no chunking into at least {p['sms']} blocks",
    "mix-not-priced": lambda p: "no chunking of the rows could be priced",
    # idle kernels (pricing/idle_guard.py): why a kernel that moves much leaves bandwidth idle
    "idle-few-rows": lambda p: _idle_grid(p, f"{p['rows']} rows of {p['length']} elements"),
    "idle-middle-axis": lambda p: _idle_grid(p, f"{p['rows']} rows of {p['length']} elements reduced over an axis "
                                                "that is not the last"),
    "idle-launch-bound": lambda p: (f"launch-bound: {p['launch_us']} of {p['us']} us is launch overhead "
                                    f"({p['launches']} launches), the bytes take {p['bandwidth_us']} us at the "
                                    "achievable bandwidth"),
    "idle-launch-cap": lambda p: (f"{p['launches']} launches of {p['mb']} MB: {p['launch_us']} us of launch overhead "
                                  f"and {p['bytes_us']} us for the bytes at the achievable bandwidth cap any plan of "
                                  f"as many launches at {p['cap']:.0%} of the peak"),
    "idle-latency-bound": lambda p: (f"latency-bound: {p['loads']} loads per thread in {p['phases']} phases, DRAM "
                                     f"round trips in each of {p['waves']} waves take {p['latency_us']} of {p['us']} us "
                                     f"(the bytes {p['bandwidth_us']} us); chosen by the time model among "
                                     f"{p['candidates']} candidate plans"),
    # attention chains (analysis/attention_chain.py, planning/attention.py)
    "attention-weights-read": lambda p: f"the attention weights {p['binding']} are read outside the chain",
    "attention-softmax-axis": lambda p: f"softmax {p['binding']} is not over the last axis",
    "attention-no-second-matmul": lambda p: f"softmax {p['binding']} does not feed a matmul",
    "attention-no-scores": lambda p: f"{p['binding']} is not a scaled (and masked) matmul",
    "attention-no-transpose": lambda p: f"softmax {p['binding']}: the scores' right operand is not a transposed K",
    "attention-shapes": lambda p: f"Q, K, V shapes {p['shapes']} do not make attention",
    "attention-window": lambda p: f"attention {p['binding']} over a sliding window",
    "attention-layout": lambda p: (f"attention {p['binding']}: Q, K, V and the output are not (batch, heads, len, "
                                   "dim) tensors permuted to and from (batch, len, heads, dim)"),
    "attention-mask-and-causal": lambda p: f"attention {p['binding']}: a causal flag and a mask",
    "attention-causal-alignment": lambda p: (f"attention {p['binding']}: a {p['alignment']} causal mask over "
                                             "different query and key lengths (the kernel aligns it at the end)"),
    "attention-symbolic-dims": lambda p: (f"Q, K, V shapes {p['shapes']}: symbolic heads or head dimension (the "
                                          "kernel takes a symbolic batch and sequence lengths)"),
    "attention-dtypes": lambda p: f"Q, K, V and the output differ in dtype ({p['dtypes']})",
    "attention-mask-shape": lambda p: f"mask of shape {p['shape']} does not broadcast to the scores",
    "attention-dtype": lambda p: f"attention in {p['dtype']}: the kernel computes float32, float16 and bfloat16",
    "attention-mask": lambda p: f"mask kind {p['mask']}",
    "attention-heads": lambda p: f"{p['heads']} heads are not a multiple of {p['kv_heads']} KV heads",
    "attention-causal-short": lambda p: f"a causal mask over {p['kv_len']} keys for {p['q_len']} queries",
    "attention-default-faster": lambda p: (f"TVM's default path (two batched matmuls around a softmax) is modeled "
                                           f"faster: {p['default_us']} us, the fused kernel {p['fused_us']} us"),
    "attention-head-dim": lambda p: f"head dimension {p['head_dim']}: no split into lanes of at most 32 elements",
    "attention-shared-memory": lambda p: (f"head dimension {p['head_dim']}: the smallest tiles exceed "
                                          f"{p['limit']} B of shared memory"),
    # accumulating scatters (planning/scatter_add.py)
    "scatter-target": lambda p: f"atomic scatter-adds are CUDA kernels ({p['family']} keeps its ordered walk)",
    "scatter-dtype": lambda p: f"a scatter-add in {p['dtype']}: {p['arch']} has no atomic add of it",
    "scatter-symbolic": lambda p: f"scatter-add shapes {p['shapes']} are symbolic",
    "scatter-shapes": lambda p: f"scatter-add shapes {p['shapes']} (out, indices, updates) do not match",
    "scatter-reduction": lambda p: f"scatter_nd with reduction {p['reduction']}: only add is accumulated atomically",
    # anything else that stopped a group
    "error": lambda p: f"{p['type']}: {p['message']}",
})


@dataclass(frozen=True)
class Reason:
    """A code of MESSAGES with its parameters."""

    code: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.code not in MESSAGES:
            raise ValueError(f"unknown reason code {self.code!r}")

    @property
    def text(self) -> str:
        return MESSAGES[self.code](self.params)

    def __str__(self) -> str:
        return self.text


class PlanError(Exception):
    """The group cannot be stitched by the available schemes; `reason` (code, params) says why."""

    def __init__(self, code: str, **params):
        self.reason = Reason(code, params)
        super().__init__(self.reason.text)

    @property
    def code(self) -> str:
        return self.reason.code

    @property
    def params(self) -> dict:
        return self.reason.params


def reason_of(err: Exception) -> Reason:
    """The reason a failure gives: a PlanError's own, else `error` with the type and last line."""
    if isinstance(err, PlanError):
        return err.reason
    return Reason("error", {"type": type(err).__name__, "message": error_line(err)})


def error_line(err: Exception) -> str:
    """The line of an exception's message that says what failed: its last line, or, for TVM's errors
    that go on with the pass and the TVMScript where it failed, the last line before those."""
    head = re.split(r"\n\s*(?:Error in pass:|Location \(TVMScript\):)", str(err).strip())[0]
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""
