"""Producers that feed only matmuls folded into them: the matmul reads through them.

FuseOps never fuses a producer into a matmul, so a transpose whose only
consumers are matmuls (the activation transposes of weight gradients,
`x^T @ dy`, the transposes of transposes of backward graphs), the copies
between a split and the attention matmuls, or a rotary embedding applied
to the queries and keys is a memory-only launch of its own. This pass runs
after AnnotateTIROpPattern and before FuseOps. What folds, when every user
of its output is a matmul:
- a pure copy (transpose, reshape, broadcast; `copy_kind`);
- an output of a split whose outputs are each a copy: it becomes a copy of
  its own, and the split goes once no output is left;
- a connected set of cheap spatial ops (no reduction, no expensive
  intrinsic: a tiled matmul loads each input element once per output tile,
  so the set is recomputed that often) that holds a gather (an injective op
  other than a copy: concat, a computed slice), which FuseOps would never
  put into a matmul's epilogue (`gather_regions`). Element-wise ops alone
  stay, for the epilogue of the matmul before them or a reduction's kernel.
The matmul call then gets a PrimFunc of its own holding the producer's
blocks before the matmul's (TVM's FuseTIR merges them), labelled like the
matmul, kept only when dlight's Matmul rule schedules it (it inlines the
producer into its global-to-shared load) and, on CUDA, the time model does
not price it above the matmul and its producers apart (pricing/fold_price.py:
every tile the matmul loads recomputes the producer, and a matmul of few
threads waits on its loads); a producer it would not schedule, or that
costs more folded, stays a kernel. A matmul's whole chain (every producer that folds, however
deep) is composed and tried at once, and each distinct composition once:
a composition costs a FuseTIR and a dlight trial (tens of milliseconds),
and a model's layers repeat theirs. Where dlight refuses a whole chain,
its matmuls fold one producer per round until nothing folds, keeping each
fold dlight schedules.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.target import Target

from tvm_stitch.analysis.classify import OpKind, classify_primfunc, is_compute_kernel
from tvm_stitch.analysis.tir_view import vars_in
from schedules.tensorize_guard import tensorize_faults, without_tensorize
from tvm_stitch.pricing.fold_price import fold_price
from tvm_stitch.rewrites.host_constants import static_tensor_bytes
from tvm_stitch.analysis.op_patterns import OUT_EWISE_FUSABLE
from tvm_stitch.rewrites.matmul_composition import call_tir_bindings, compose_calls, composition_wiring
from tvm_stitch.rewrites.matmul_epilogue import copy_kind
from tvm_stitch.stitch_target import StitchTarget

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_SPATIAL = (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.INJECTIVE)


def _users(func: relax.Function) -> dict:
    uses: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                uses.setdefault(var, []).append(binding.var)
    for var in relax.analysis.free_vars(func.body.body):
        uses.setdefault(var, []).append(None)
    return uses


class _Kinds:
    """Per PrimFunc (by GlobalVar), whether it is a matmul, and whether a pure copy."""

    def __init__(self, mod: tvm.IRModule):
        self.mod = mod
        self.matmul: dict = {}
        self.copy: dict = {}
        self.spatial: dict = {}

    def is_matmul(self, call: relax.Call) -> bool:
        gv = call.args[0]
        if gv not in self.matmul:
            func = self.mod[gv]
            pattern = func.attrs.get("op_pattern") if isinstance(func, tirx.PrimFunc) and func.attrs is not None \
                else None
            self.matmul[gv] = pattern is not None and int(pattern) == OUT_EWISE_FUSABLE and is_compute_kernel(func)
        return self.matmul[gv]

    def is_copy(self, call: relax.Call) -> bool:
        gv = call.args[0]
        if gv not in self.copy:
            self.copy[gv] = isinstance(self.mod[gv], tirx.PrimFunc) and bool(copy_kind(self.mod[gv]))
        return self.copy[gv]

    def spatial_kind(self, call: relax.Call):
        """The OpKind of a cheap spatial call with one output, else None."""
        if len(call.ty_args) != 1 or not isinstance(call.ty_args[0], relax.TensorType):
            return None
        gv = call.args[0]
        if gv not in self.spatial:
            cls = classify_primfunc(self.mod[gv])
            cheap = not cls.expensive or self.is_copy(call)  # a copy's index arithmetic is no cost per tile
            self.spatial[gv] = cls.kind if cls.kind in _SPATIAL and cheap else None
        return self.spatial[gv]


def gather_regions(kinds: _Kinds, func: relax.Function) -> set:
    """Vars of the cheap spatial calls that fold with a gather into the matmuls they feed.

    The candidates are the cheap spatial calls all of whose users are matmuls or other candidates;
    a connected set of them folds when it holds a gather (an injective op that is not a pure copy:
    concat, a slice with computed indices, take): FuseOps never puts a gather into a matmul's
    epilogue, so the set would be a launch of its own. A set of element-wise ops alone is left to
    the epilogue of the matmul before it (SwiGLU's product) or to the reduction's kernel (a norm's
    scaling)."""
    calls = call_tir_bindings(func)
    uses = _users(func)
    region = {v for v, c in calls.items() if not kinds.is_matmul(c) and kinds.spatial_kind(c) is not None}
    changed = True
    while changed:
        changed = False
        for var in list(region):
            if not all(u in region or (u in calls and kinds.is_matmul(calls[u])) for u in uses.get(var, [None])):
                region.discard(var)
                changed = True
    parent = {v: v for v in region}

    def root(v):
        while parent[v] is not v:
            v = parent[v]
        return v

    for var in region:
        for arg in calls[var].args[1].fields:
            if arg in region:
                parent[root(arg)] = root(var)
    gathers = {root(v) for v in region
               if kinds.spatial_kind(calls[v]) == OpKind.INJECTIVE and not kinds.is_copy(calls[v])}
    return {v for v in region if root(v) in gathers}


def _fold_sites(kinds: _Kinds, func: relax.Function, output_call, gathered: set):
    """(matmul var, argument position, producer call) of each foldable producer, in binding order.

    A producer is a call_tir of a pure copy, one in `gathered` (see `gather_regions`), or an output of a multi-output copy (a split), which
    `output_call(split call, index)` turns into a call of that output's own copy (or None)."""
    calls = call_tir_bindings(func)
    items = {b.var: b.value for block in func.body.blocks for b in block.bindings
             if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in calls}
    uses = _users(func)
    for var, call in calls.items():
        if not kinds.is_matmul(call):
            continue
        for position, arg in enumerate(call.args[1].fields):
            if not all(user in calls and kinds.is_matmul(calls[user]) for user in uses.get(arg, [None])):
                continue
            producer = calls.get(arg)
            if producer is None and arg in items:
                producer = output_call(calls[items[arg].tuple_value], items[arg].index)
            if producer is not None and (arg in gathered or kinds.is_copy(producer)):
                yield var, position, producer


def _producer_bytes(matmul: relax.Call, chain: list) -> int:
    """Bytes a kernel of the `chain`'s producers alone would move: the inputs they read from outside
    the chain and the results the matmul reads, each once; -1 where a size is symbolic."""
    inside = {var for var, _ in chain}
    inputs = {a for _, p in chain for a in p.args[1].fields if a not in inside}
    results = {a for a in matmul.args[1].fields if a in inside}
    sizes = [static_tensor_bytes(v.ty) for v in inputs | results]
    return -1 if None in sizes else sum(sizes)


def defines_its_sizes(func: tirx.PrimFunc) -> bool:
    """Whether every size `func`'s body uses is a parameter, a dimension of a parameter's shape or a
    loop, block or let variable (a fold over symbolic shapes can leave a size of a folded producer
    undefined: MakePackedAPI then refuses the function)."""
    defined = set(func.params)
    for param in func.params:
        # Only a dimension that is a variable itself defines it (not `2 * s`).
        defined |= {dim for dim in getattr(param.ty, "shape", ()) if isinstance(dim, tirx.Var)}
    tvm_ffi.structural_walk(func.body, ((tirx.For, lambda loop: defined.add(loop.loop_var)),
                                        (tirx.IterVar, lambda iv: defined.add(iv.var)),
                                        (tirx.LetStmt, lambda let: defined.add(let.var))), order="post")
    sizes = {v for v in vars_in(func.body) if str(v.ty).startswith(("int", "uint"))}
    return sizes <= defined


def matmul_rule_applies(func: tirx.PrimFunc, target: Target) -> bool:
    """Whether dlight's Matmul rule schedules `func` for `target` (never reaching a faulting Tensorize)."""
    from tvm.s_tir import dlight as dl

    func = without_tensorize(func) if tensorize_faults() else func
    try:
        return dl.gpu.Matmul().apply(func, target, False) is not None
    except Exception:  # noqa: BLE001 - a rule that raises does not apply
        return False


def _chains(kinds: _Kinds, func: relax.Function, output_call, gathered: set) -> dict:
    """Matmul var -> [(var, producer call)] in binding order: the whole chain that folds into it.

    A var folds when its producer would be a fold site (see `_fold_sites`) and every user of it is a
    matmul or a var that folds too: what folding one producer per round would reach, once every
    round's fold is scheduled. A var feeding two matmuls is in both chains."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    order = {b.var: i for i, b in enumerate(bindings)}
    calls = call_tir_bindings(func)
    items = {b.var: b.value for b in bindings
             if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in calls}
    uses = _users(func)
    folding = {v for v, c in calls.items() if not kinds.is_matmul(c) and (v in gathered or kinds.is_copy(c))}
    folding |= set(items)
    producers: dict = {}
    changed = True
    while changed:
        changed = False
        for var in sorted(folding, key=order.get):
            if all(u in folding or (u in calls and kinds.is_matmul(calls[u])) for u in uses.get(var, [None])):
                if var not in producers:  # an output of a split: a copy of its own, or None
                    producers[var] = calls[var] if var in calls else \
                        output_call(calls[items[var].tuple_value], items[var].index)
                if producers[var] is not None and (var in calls or kinds.is_copy(producers[var])):
                    continue
            folding.discard(var)
            changed = True
    chains = {}
    for var, call in calls.items():
        if not kinds.is_matmul(call):
            continue
        members, pending = set(), [a for a in call.args[1].fields if a in folding]
        while pending:
            member = pending.pop()
            if member not in members:
                members.add(member)
                pending.extend(a for a in producers[member].args[1].fields if a in folding)
        if members:
            chains[var] = [(v, producers[v]) for v in sorted(members, key=order.get)]
    return chains


@tvm.transform.module_pass(opt_level=0, name="FoldProloguesIntoMatmuls")
class FoldProloguesIntoMatmuls:
    """Folds the producers that feed only matmuls into them (see the module docstring).

    Each matmul's whole chain is composed and tried at once (one FuseTIR and one dlight trial per
    distinct composition: the layers of a model share them); where dlight's Matmul rule refuses a
    chain, its matmuls fold one producer per round instead, keeping what it schedules."""

    def __init__(self, target, report=None):
        self.target = StitchTarget.of(target)
        self.report = report  # a StitchReport: each boundary left because dlight would not schedule it

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        folder = PrologueFolder(mod, self.target, self.report)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                folder.fold_function(gv, func)
        return folder.module()


class PrologueFolder:
    """The folds of one module. `mod` grows by the PrimFuncs the folds add (each composition, each
    split output's own copy) and takes each rewritten function; the caches make each composition,
    trial and split output once."""

    def __init__(self, mod: tvm.IRModule, target, report=None):
        made = StitchTarget.of(target)
        self.mod = mod
        self.target = made.target
        self.spec = made.spec if made.builds_cuda else None  # prices folds
        self.report = report  # a StitchReport: each boundary left because dlight would not schedule it
        self.kinds = _Kinds(mod)
        self.composed: dict = {}  # wiring key -> (GlobalVar, argument order), or why it does not fold
        self.noted: set = set()  # the keys whose reason the report has
        self.tried: dict = {}  # structural hash -> [(PrimFunc, GlobalVar or None)]: one trial per composition
        self.outputs: dict = {}  # (split PrimFunc, output index) -> GlobalVar of that output's copy, or None

    def _add(self, prim: tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
        builder = relax.BlockBuilder(self.mod)
        gv = builder.add_func(prim, name)
        self.mod = self.kinds.mod = builder.get()
        return gv

    def output_call(self, split: relax.Call, index: int) -> relax.Call | None:
        """A call of output `index` of the `split` call as a copy of its own (None where it is not one)."""
        key = (split.args[0], index)
        if key not in self.outputs:
            sliced = split_output(self.mod[split.args[0]], index)
            self.outputs[key] = self._add(sliced, f"{split.args[0].name_hint}_{index}") if sliced is not None else None
        if self.outputs[key] is None:
            return None
        return relax.Call(split.op, [self.outputs[key], split.args[1]], split.attrs, [split.ty_args[0].fields[index]])

    def scheduled(self, prim: tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar | None:
        """The GlobalVar of `prim` where dlight's Matmul rule schedules it, else None."""
        same = self.tried.setdefault(tvm_ffi.structural_hash(prim), [])
        for other, other_gv in same:
            if tvm_ffi.structural_equal(prim, other):
                return other_gv
        new_gv = None
        if defines_its_sizes(prim) and matmul_rule_applies(prim, self.target):
            new_gv = self._add(prim, name)
        same.append((prim, new_gv))
        return new_gv

    def _composition(self, matmul: relax.Call, chain: list, leaves: list):
        """(callee, argument order) of `chain` composed with `matmul`, or why it does not fold."""
        try:
            prim, order = compose_calls(self.mod, matmul, chain, leaves)
            slower = self.slower(prim, matmul, chain)
            callee = None if slower else self.scheduled(prim, f"{matmul.args[0].name_hint}_prologue")
        except (RuntimeError, TypeError, ValueError) as err:  # FuseTIR refused the composition
            return f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}"
        return (callee, order) if callee is not None else slower or "dlight's Matmul rule does not schedule the two as one"

    def slower(self, prim: tirx.PrimFunc, matmul: relax.Call, chain: list) -> str:
        """Why the folded `prim` is not kept although dlight may schedule it: slower in modeled time
        than the matmul and its producers apart (pricing/fold_price.py); "" where it is not."""
        if self.spec is None or self.spec.hbm_bytes_per_us <= 0:
            return ""
        price = fold_price(prim, self.mod[matmul.args[0]], _producer_bytes(matmul, chain), self.target, self.spec)
        return "" if price.pays else (f"folded, modeled {price.folded_us:.1f} us; apart {price.apart_us:.1f} us "
                                      "(the matmul's loads recompute the producer per tile)")

    def fold(self, matmul: relax.Call, chain: list, note: bool) -> relax.Call | None:
        """The call of `matmul` reading through `chain`, or None (the reason noted in the report
        if `note`, once per composition)."""
        key, leaves = composition_wiring(matmul, chain)
        if key not in self.composed:
            self.composed[key] = self._composition(matmul, chain, leaves)
        if isinstance(self.composed[key], str):
            if note and key not in self.noted and self.report is not None:
                self.noted.add(key)
                self.report.notes.append(f"{', '.join(p.args[0].name_hint for _, p in chain)} stays a kernel "
                                         f"before {matmul.args[0].name_hint}: {self.composed[key]}")
            return None
        callee, order = self.composed[key]
        return relax.Call(matmul.op, [callee, relax.Tuple([leaves[i] for i in order])], matmul.attrs,
                          matmul.ty_args)

    def fold_chains(self, func: relax.Function, gathered: set) -> tuple:
        """(func with every matmul's whole chain folded where dlight schedules it, whether some chain
        was refused). A chain sharing a var with a refused one waits for `fold_round`: that var may stay."""
        chains = _chains(self.kinds, func, self.output_call, gathered)
        calls = call_tir_bindings(func)
        folds = {var: self.fold(calls[var], chain, note=False) for var, chain in chains.items()}
        refused = {v for var, chain in chains.items() if folds[var] is None for v, _ in chain}
        new_values = {var: call for var, call in folds.items()
                      if call is not None and not any(v in refused for v, _ in chains[var])}
        if not new_values:
            return func, bool(refused)
        index_of = {b.var: i for i, b in enumerate(b for block in func.body.blocks for b in block.bindings)}
        folded_vars = sorted({v for var in new_values for v, _ in chains[var]}, key=index_of.get)
        return _replace_bindings(func, new_values, folded_vars), bool(refused)

    def fold_round(self, func: relax.Function, gathered: set) -> relax.Function | None:
        """`func` with at most one more producer folded into each matmul (None when nothing folds)."""
        calls = call_tir_bindings(func)
        new_values, old_args = {}, []
        for var, position, producer in list(_fold_sites(self.kinds, func, self.output_call, gathered)):
            arg = calls[var].args[1].fields[position]
            if var in new_values or arg in old_args:
                continue
            call = self.fold(calls[var], [(arg, producer)], note=True)
            if call is not None:
                new_values[var] = call
                old_args.append(arg)
        return _replace_bindings(func, new_values, old_args) if new_values else None

    def fold_function(self, gv: tvm.ir.GlobalVar, func: relax.Function) -> None:
        """Fold the prologues of `func`'s matmuls: whole chains, then, where dlight refused one,
        one producer per round until nothing folds; the module takes each rewritten function."""
        gathered = gather_regions(self.kinds, func)
        folded, refused = self.fold_chains(func, gathered)
        if folded is not func:
            self.mod[gv] = func = folded
        if not refused:
            return
        while (rounded := self.fold_round(func, gathered)) is not None:
            self.mod[gv] = func = rounded

    def module(self) -> tvm.IRModule:
        """The module, less the split outputs' copies no call uses."""
        mod = self.mod
        called = {call.args[0] for f in mod.functions.values() if isinstance(f, relax.Function)
                  for call in call_tir_bindings(f).values()}
        unused = [gv for gv in self.outputs.values() if gv is not None and gv not in called]
        return tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in unused}, attrs=mod.attrs) \
            if unused else mod


def _replace_bindings(func: relax.Function, new_values: dict, old_args: list) -> relax.Function:
    """`func` with each var of `new_values` bound to its new value, without the bindings of the
    `old_args` nothing uses any more, nor (for an output of a split) the split's once nothing uses
    any of its outputs."""
    bindings = [relax.VarBinding(b.var, new_values[b.var]) if b.var in new_values else b
                for block in func.body.blocks for b in block.bindings]
    values = {b.var: b.value for b in bindings}
    uses: dict = {}
    for b in bindings:
        for var in relax.analysis.free_vars(b.value):
            uses[var] = uses.get(var, 0) + 1
    for var in relax.analysis.free_vars(func.body.body):
        uses[var] = uses.get(var, 0) + 1
    dead = set()
    pending = list(old_args)
    while pending:
        candidate = pending.pop()
        if candidate in dead or uses.get(candidate, 0):
            continue
        dead.add(candidate)
        for var in relax.analysis.free_vars(values[candidate]) if candidate in values else []:
            uses[var] -= 1
        source = values.get(candidate)
        if isinstance(source, relax.TupleGetItem):
            pending.append(source.tuple_value)
    blocks = []
    for block in func.body.blocks:
        kept = [relax.VarBinding(b.var, new_values[b.var]) if b.var in new_values else b for b in block.bindings
                if b.var not in dead]
        blocks.append(relax.DataflowBlock(kept) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(kept))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def split_output(func: tirx.PrimFunc, index: int) -> tirx.PrimFunc | None:
    """Output `index` of a multi-output copy (a split: one block per output) as a PrimFunc of its own
    (the input, that output), or None when `func` is not one loop nest per output reading one input."""
    if not isinstance(func.body, s_tir.SBlockRealize):
        return None
    root = func.body.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    inputs = len(func.params) - len(nests)
    if inputs != 1 or root.alloc_buffers or not 0 <= index < len(nests):
        return None
    output = func.params[inputs + index]
    writers = []
    for nest in nests:
        found = []
        tvm_ffi.structural_walk(nest, (s_tir.SBlock, found.append), order="pre")
        writers.append(found)
    if any(len(blocks) != 1 or len(blocks[0].writes) != 1 for blocks in writers):
        return None
    (nest,) = [n for n, blocks in zip(nests, writers) if blocks[0].writes[0].source.same_as(output)] or [None]
    if nest is None:
        return None
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", nest))
    sliced = tirx.PrimFunc([func.params[0], output], body, attrs=func.attrs)
    return sliced if copy_kind(sliced) else None
