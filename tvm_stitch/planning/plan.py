"""The stitch plan: plain data, no TVM objects, so it prints, compares and serialises."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

from tvm_stitch.planning.reasons import Reason
from tvm_stitch.planning.spec import TargetSpec

REGISTER = "register"  # in the thread that uses it: inlined (recomputed per use) or computed once
SHARED = "shared"  # one copy per row task, visible to the task's threads
GLOBAL = "global"  # written to device memory
MIN_LANES = 4  # the narrowest vector the CPU schedules emit (narrower lanes stay scalar)


class PhaseRole(str, Enum):
    """What a row-split block does in its kernel."""

    COMPUTE = "compute"  # an element-wise block, or the per-chunk partials of a reduction
    COMBINE = "combine"  # the per-row combine of a reduction's partials


@dataclass(frozen=True)
class Phase:
    """Row-split: the kernel (launch index) in which a block, or its combine, runs."""

    block: str
    kernel: int
    role: PhaseRole = PhaseRole.COMPUTE


@dataclass(frozen=True)
class Intermediate:
    """One value produced inside the kernel and consumed inside it."""

    name: str  # the producing block
    level: str  # REGISTER | SHARED | GLOBAL
    bytes_per_row: int
    why: str
    inlined: bool = False  # REGISTER only: recomputed inside each consumer instead of stored


@dataclass(frozen=True)
class ThreadMapping:
    """How row tasks map to the machine.

    CUDA: one thread block per `rows_per_task` rows, `threads` threads each.
    CPU: row tasks spread over `threads` cores, `vector` lanes per loop;
    rows that are columns of the inputs go `rows_per_task` per task, in
    vector lanes, and a long reduced axis is cut into `split` chunks summed
    in parallel, then combined. With `across`, short rows go across the
    `vector` lanes instead (a lane per row, each row's loops unrolled).
    Row-split (CUDA): `split` blocks per row, `grid` = rows x split.
    With one thread per row (CUDA `threads` 1: element-wise, or rows walking columns), a block's
    `rows_per_task` threads take a row each, `row_elements` elements long (1: an element each;
    then `vector` elements per thread, a block's width apart). With `across` (CUDA row-resident,
    column tiles), a block's `rows_per_task` rows go across threadIdx.x and each row's `threads`
    threads along threadIdx.y.
    """

    rows: int  # row tasks in total (product of the row extents)
    rows_per_task: int
    threads: int
    vector: int
    grid: int  # CUDA blocks, or CPU parallel iterations
    split: int = 1  # chunks per row: one thread block each (CUDA row-split), parallel partials (CPU)
    across: bool = False  # CPU: vector lanes across rows (a lane per row); CUDA: rows across threadIdx.x
    row_elements: int = -1  # CUDA row-resident: the most elements a block has in one row (-1: not static)
    combining_blocks: int = 0  # CUDA mix-order: the last blocks that sum the column partials (0: a second launch)
    last_block_rows: bool = False  # CUDA row-split: one launch, each row's later phases in its last block


@dataclass(frozen=True)
class StitchPlan:
    kernel: str
    target: str  # "cuda" or "cpu"
    scheme: str  # e.g. "row-resident"
    ops: tuple  # names of the fused blocks, in program order
    dominant: tuple  # blocks whose mapping the others follow
    rank: int  # leading axes that form the rows
    row_shape: tuple
    mapping: ThreadMapping
    intermediates: tuple = ()
    outputs: tuple = ()  # blocks that write the kernel's outputs
    cached_inputs: tuple = ()  # inputs whose row is loaded once into shared memory, then reused
    shared_bytes: int = 0  # CUDA: static shared memory per block (resources.cuda_shared_bytes)
    shared_rows: tuple = ()  # CUDA: bytes per row of each shared buffer (on-chip intermediates, cached input rows)
    shared_reductions: tuple = ()  # CUDA: (value bytes, outputs per row) of each reduced value of the kernel
    modeled_bytes: int = -1  # global-memory traffic of the scheduled kernel (see traffic.py)
    ideal_bytes: int = -1  # its inputs read once and outputs written once
    modeled_us: float = -1.0  # CUDA: the time model's microseconds for its launches (planning/time_model.py)
    reductions: int = 0  # reduction blocks in the kernel
    kernels: int = 1  # launches of this PrimFunc (row-split: one per phase)
    registers: int = -1  # CUDA: estimated registers per thread (resources.py)
    occupancy: float = -1.0  # CUDA: resident warps per SM over the maximum, from threads, registers, shared
    phases: tuple = ()  # row-split: a Phase per kept block and per reduction's combine
    online: tuple = ()  # row-split: (sum, max) pairs whose partials take one pass (online softmax)
    variance: tuple = ()  # row-split: (squared deviations, sum) pairs whose partials take one pass
    recomputed_outputs: tuple = ()  # row-split: element-wise outputs their readers recompute (not load)
    notes: tuple = field(default=())
    aligned_depth: int = -1  # leading axes aligned across the kernel's blocks: ranks 1..aligned_depth are valid
    # Rows not leading: (block, positions of its row iterators, factors: 0 the iterator, k its
    # quotient by k) per block, moved first before planning and scheduling (analysis/row_axes.py);
    # () when the rows are the leading axes.
    row_axes: tuple = ()
    # Rows through a reshape: blocks re-laid out over the shape of the tensor they reshape before
    # planning and scheduling (analysis/reshaped_rows.py); () when none is.
    reshaped: tuple = ()
    # Symbolic row lengths planned for their upper bound: (size, bound) pairs; the schedule runs the
    # row's loops to the bound under a guard. () for static or streamed row lengths.
    bounds: tuple = ()
    spec: TargetSpec | None = None  # the hardware the plan was made for
    # CUDA: why a kernel that moves much is modeled far under the peak bandwidth (pricing/idle_guard.py)
    idle: Reason | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "StitchPlan":
        data = json.loads(text)
        data["mapping"] = ThreadMapping(**data["mapping"])
        data["intermediates"] = tuple(Intermediate(**i) for i in data["intermediates"])
        for key in ("ops", "dominant", "row_shape", "outputs", "cached_inputs", "notes", "shared_rows",
                    "recomputed_outputs", "reshaped"):
            data[key] = tuple(data.get(key, ()))
        data["shared_reductions"] = tuple(tuple(r) for r in data.get("shared_reductions", ()))
        data["online"] = tuple(tuple(pair) for pair in data.get("online", ()))
        data["variance"] = tuple(tuple(pair) for pair in data.get("variance", ()))
        data["row_axes"] = tuple((block, tuple(positions), tuple(factors))
                                 for block, positions, factors in data.get("row_axes", ()))
        data["bounds"] = tuple(tuple(pair) for pair in data.get("bounds", ()))
        data["phases"] = tuple(Phase(p["block"], p["kernel"], PhaseRole(p["role"])) for p in data.get("phases", ()))
        if data.get("idle") is not None:
            data["idle"] = Reason(**data["idle"])
        if data.get("spec") is not None:
            data["spec"] = TargetSpec.from_dict(data["spec"])
        return StitchPlan(**data)

    def phase_kernels(self, role: PhaseRole) -> dict:
        """Row-split: block name -> kernel index, for the phases of one role."""
        return {p.block: p.kernel for p in self.phases if p.role == role}

    @property
    def phase_count(self) -> int:
        """Row-split: its phases (a launch each, or one launch in all with `mapping.last_block_rows`)."""
        return max((p.kernel for p in self.phases), default=self.kernels - 1) + 1

    @property
    def threads_per_block(self) -> int:
        return self.mapping.threads * self.mapping.rows_per_task

    def inlined(self) -> list:
        return [i.name for i in self.intermediates if i.inlined]
