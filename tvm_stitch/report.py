"""What the stitch pass decided, per group: the plan, or why it fell back."""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.reasons import Reason
from tvm_stitch.planning.spec import TargetSpec
from tvm_stitch.planning.time_model import peak_bytes_per_us


@dataclass
class GroupRecord:
    function: str  # the Relax function holding the group
    bindings: tuple  # names of the Relax variables the group computes
    ops: tuple  # names of the legalized operators in the group
    op_kinds: tuple = ()  # their classification (elementwise, reduction, ...)
    kernel: str = ""  # name of the stitched PrimFunc ("" when it fell back)
    plan: StitchPlan | None = None
    reason: Reason | None = None  # why the group took TVM's default path (code and parameters)
    positions: tuple = ()  # (dataflow block index, binding index) of each binding (names may repeat)
    recomputed: tuple = ()  # ops of cheap producers the kernel computes again instead of reading
    stage: str = ""  # the last stage the group passed: "outlined", "planned" or "scheduled" ("": none)
    # (condition on the sizes, plan) of each variant chosen at run time, in the dispatch's order, the
    # last ("otherwise") being `plan`; () for a kernel of one plan
    variants: tuple = ()

    @property
    def stitched(self) -> bool:
        return self.plan is not None

    @property
    def fallback(self) -> str:
        """The reason rendered as prose ("" when the group was stitched)."""
        return self.reason.text if self.reason is not None else ""


@dataclass
class StitchReport:
    target: str = ""
    spec: TargetSpec | None = None  # the hardware the plans were made for
    groups: list = field(default_factory=list)
    opaque: list = field(default_factory=list)  # (binding, reason) left to TVM's default path
    packs: list = field(default_factory=list)  # (packed kernel, member kernels): one launch each
    notes: list = field(default_factory=list)
    searches: list = field(default_factory=list)  # fusion_search.SearchRecord per block searched
    attention: list = field(default_factory=list)  # rewrites/attention.AttentionRecord per attention chain
    scatters: list = field(default_factory=list)  # rewrites/scatter_add.ScatterRecord per scatter_nd (CUDA)
    gemms: list = field(default_factory=list)  # pricing/gemm_choice.GemmChoice per GEMM the tensor-core rule took

    @property
    def plans(self) -> list:
        return [g.plan for g in self.groups if g.plan is not None]

    @property
    def fallbacks(self) -> list:
        return [g for g in self.groups if g.fallback]

    def table(self) -> str:
        rows = [("kernel", "ops", "scheme", "dominant", "mapping", "reuse (register/shared/global)",
                 "modeled / ideal MB", "modeled us (of peak BW)")]
        for group in self.groups:
            plan = group.plan
            ops = _short(",".join(group.ops), 44)
            if plan is None:
                rows.append(("-", ops, "fallback", "-", "-", _short(group.fallback, 60), "-", "-"))
                continue
            mapping = _mapping(plan)
            levels = {"register": [], "shared": [], "global": []}
            for inter in plan.intermediates:
                levels[inter.level].append(inter.name)
            reuse = "/".join(str(len(levels[k])) for k in ("register", "shared", "global"))
            traffic = (f"{plan.modeled_bytes / 1e6:.1f} / {plan.ideal_bytes / 1e6:.1f}"
                       if plan.modeled_bytes >= 0 else "symbolic")
            rows.append((plan.kernel, ops, plan.scheme, _short(",".join(plan.dominant), 30), mapping, reuse,
                         traffic, _modeled_time(plan)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.spec is not None:
            lines.insert(0, f"plans made for {self.spec.describe()}")
        stitched = sum(1 for g in self.groups if g.stitched)
        lines.append(f"{stitched} stitched kernels, {len(self.fallbacks)} fallbacks, "
                     f"{len(self.opaque)} bindings left to TVM (compute-intensive or other)")
        for packed, members in self.packs:
            lines.append(f"independent: {packed} launches {len(members)} kernels at once: {', '.join(members)}")
        for group in self.fallbacks:
            lines.append(f"fallback [{','.join(group.ops)}]: {group.fallback}")
        lines.extend(f"idle {plan.kernel} [{plan.idle.code}]: {plan.idle.text}" for plan in self.plans if plan.idle)
        lines.extend(_search_line(record) for record in self.searches)
        for group in self.groups:
            lines.extend(_variant_lines(group))
        for group in self.groups:
            if group.stitched and group.recomputed:
                lines.append(f"recomputed in {group.kernel}: [{','.join(group.recomputed)}] (computed again "
                             f"instead of read from memory)")
        lines.extend(record.line() for record in self.attention)
        lines.extend(record.line() for record in self.scatters)
        lines.extend(record.line() for record in self.gemms)
        lines.extend(self.notes)
        return "\n".join(lines)

    def details(self) -> str:
        """Every plan in full: mapping and the level of each intermediate."""
        out = [f"plans made for {self.spec.describe()}"] if self.spec is not None else []
        for plan in self.plans:
            out.append(f"{plan.kernel}: {plan.scheme}, rows {plan.row_shape}, dominant {list(plan.dominant)}")
            out.append(f"  mapping: {plan.mapping}")
            if plan.row_axes:
                moved = ", ".join(f"{block} {list(positions)}" + (f" split by {list(factors)}" if any(factors) else "")
                                  for block, positions, factors in plan.row_axes)
                out.append(f"  row axes moved first (block, iterator positions): {moved}")
            if plan.cached_inputs:
                out.append(f"  inputs loaded once into shared memory: {', '.join(plan.cached_inputs)}")
            if plan.modeled_bytes >= 0:
                out.append(f"  modeled global traffic {plan.modeled_bytes} B, ideal {plan.ideal_bytes} B")
            if plan.modeled_us >= 0:
                out.append(f"  modeled time {_modeled_time(plan)} for {plan.kernels} launch(es) "
                           "(time model: docs/time-model.md)")
            if plan.registers >= 0:
                out.append(f"  resources: ~{plan.registers} registers/thread (estimate), {plan.shared_bytes} B shared, "
                           f"{plan.threads_per_block} threads/block, occupancy {plan.occupancy:.0%}")
            if plan.idle is not None:
                out.append(f"  idle [{plan.idle.code}]: {plan.idle.text}")
            for inter in plan.intermediates:
                out.append(f"  {inter.name:28s} {inter.level:8s} {inter.bytes_per_row:7d} B/row  {inter.why}")
            for note in plan.notes:
                out.append(f"  note: {note}")
        for group in self.groups:
            out.extend(_variant_lines(group))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _mapping(plan: StitchPlan) -> str:
    """The table's mapping column: what the kernel's launches do (blocks, threads per block, what a
    block and a thread take; cores and vector lanes on the CPU)."""
    m = plan.mapping
    if plan.scheme == "row-split":
        per_thread = f", {m.rows_per_task} rows/blk, 1 row/thr" if m.threads == 1 else ""
        launches = "1 kernel, phase 1 in each row's last block" if m.last_block_rows else f"{plan.kernels} kernels"
        return f"{m.grid} blocks ({m.split} blocks/row) x {plan.threads_per_block} thr{per_thread}, {launches}"
    if plan.scheme == "column-split":
        return (f"{m.grid} blocks ({m.split} row chunks) x {m.threads}x{m.rows_per_task} thr "
                f"(columns x rows), vec {m.vector}, {plan.kernels} kernels")
    if plan.target == "cuda":
        grid = m.grid if m.grid >= 0 else "x".join(plan.row_shape) + (
            f"/{m.rows_per_task}" if m.rows_per_task > 1 else "")
        return f"{grid} blocks x {_cuda_block(m)}" + "".join(f", for {name} <= {upper}" for name, upper in plan.bounds)
    row_count = m.rows if m.rows >= 0 else "x".join(plan.row_shape)
    return f"{row_count} rows / {m.threads} cores, vec {m.vector}{' across rows' if m.across else ''}"


def _cuda_block(m) -> str:
    """A CUDA row-resident block: its threads and rows; with a thread per row (element-wise: an
    element per thread), what each thread takes."""
    if m.threads > 1:
        spread = f" ({m.threads} thr/row{', rows across' if m.across else ''})" if m.rows_per_task > 1 else ""
        return f"{m.threads * m.rows_per_task} thr, {m.rows_per_task} row/blk{spread}"
    if m.row_elements == 1:
        return f"{m.rows_per_task} thr, {max(1, m.vector)} elem/thr"
    length = f" ({m.row_elements} elem)" if m.row_elements > 1 else ""
    return f"{m.rows_per_task} thr, 1 row/thr{length}"


def _search_line(r) -> str:
    """One block's fusion search: the plan used, its modeled time and greedy's, proven or not, time taken."""
    times = (f"{r.chosen_us:.1f} us against greedy's {r.greedy_us:.1f} us" if r.greedy_us >= 0
             else "not priced")
    why = f" ({r.why})" if r.why else ""
    return (f"fusion {r.method} in {r.function} block {r.block}{why}: {times}, "
            f"optimum {'proven' if r.proven else 'not proven'}, {r.candidates} candidates, {r.seconds:.2f} s")


def _variant_lines(group: GroupRecord) -> list:
    """The size variants of a group's kernel, one line each, in the order the dispatch tries them."""
    if not group.variants:
        return []
    lines = [f"size variants of {group.kernel} (chosen at run time, first whose condition holds):"]
    for condition, plan in group.variants:
        lines.append(f"  {condition}: {plan.scheme}, {_variant_shape(plan)}{_variant_at(plan)}")
    return lines


def _variant_shape(plan: StitchPlan) -> str:
    """How a variant's plan maps rows: blocks per row, cores and lanes, or rows per block."""
    m = plan.mapping
    if plan.scheme == "row-split":
        launches = "1 kernel (last block per row)" if m.last_block_rows else f"{plan.kernels} kernels"
        return f"{m.split} blocks/row x {m.threads} thr, {launches}"
    if plan.target == "cpu":
        rows = f"{m.split} chunks/row" if m.split > 1 else "rows"
        return f"{rows} over {m.threads} cores, vector {m.vector}{' across rows' if m.across else ''}"
    if m.threads == 1:
        return _cuda_block(m)
    return f"{m.rows_per_task} row/blk x {m.threads} thr"


def _variant_at(plan: StitchPlan) -> str:
    """', at R rows B MB[, time]': the static count a variant was planned at, with its modeled traffic
    and time there; '' where it has none."""
    if plan.mapping.rows < 0 or plan.modeled_bytes < 0:
        return ""
    time = f", {_modeled_time(plan)}" if plan.modeled_us >= 0 else ""
    return f", at {plan.row_shape[0]} rows {plan.modeled_bytes / 1e6:.1f} MB{time}"


def _modeled_time(plan: StitchPlan) -> str:
    """'8.8 us (55%)': the plan's modeled time, and its modeled bytes over that time as a share of
    the peak bandwidth of the arch it was planned for; '-' where not modeled (CPU, symbolic sizes)."""
    if plan.modeled_us < 0:
        return "-"
    if plan.modeled_bytes < 0 or plan.spec is None:
        return f"{plan.modeled_us:.1f} us"
    share = plan.modeled_bytes / plan.modeled_us / peak_bytes_per_us(plan.spec)
    return f"{plan.modeled_us:.1f} us ({share:.0%})"


def kernel_bound_lines(title: str, kernels) -> list:
    """Per CUDA kernel of a priced module (tools/module_time.ModuleTime.kernels: (PrimFunc, calls,
    KernelTimes)): its modeled time, the part that bounds it (bandwidth, latency, compute, sfu,
    serial or launch) and its share of the math peak (its operations over each unit's peak) and of
    the peak bandwidth."""
    rows = [("kernel", "calls", "modeled us", "bound", "of math peak", "of peak BW")]
    for _, calls, times in kernels:
        for t in times:
            rows.append((t.name, str(calls), f"{t.us:.1f}", t.bound, f"{t.math_fraction:.0%}",
                         f"{t.bandwidth_fraction:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return [title, lines[0], "  ".join("-" * w for w in widths)] + lines[1:]


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
