"""Which stitched kernels share a launch (independent stitching), and the rewrite that packs them.

Within one dataflow block, calls of stitched kernels that have no data path
between them (directly or through any other binding) and the same launch
shape (on the CPU also tasks of about the same size) are packed — up to
`MAX_PACK` per launch — into one kernel built by `schedules.independent.pack`.
Only kernels that are one loop over their tasks can be packed; kernels with
barriers (shared memory, cross-thread reductions) are left alone (a row-resident
kernel's packed rows put them under thread-dependent predicates), except
one-launch column-split kernels, packed with those of their block shape.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from schedules.independent import loop_signature, pack

from tvm_stitch.planning.plan import StitchPlan

MAX_PACK = 32
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def packable(plan: StitchPlan) -> bool:
    """CPU kernels but those with rows across the vector lanes (LLVM vectorises their row loop, not
    a pack's loop that branches per task: there it gathers and scatters); CUDA kernels without
    barriers (one thread per row); one-launch column-split kernels, packed only with column-split
    kernels of their block shape: their barriers sit under the branch that selects a member, which
    depends on the block index alone (uniform over a block)."""
    if plan.scheme == "column-split":
        return plan.kernels == 1
    if plan.target == "cpu":
        return not plan.mapping.across
    return plan.mapping.threads == 1


def _one_task_loop(func) -> bool:
    """Whether the kernel is one loop over its tasks (what `pack` concatenates); a kernel with a
    loop nest per block (CPU chunks of few long rows, partials then their combine) is not."""
    try:
        loop_signature(func)
    except ValueError:
        return False
    return True


def _task_size(plan: StitchPlan) -> int:
    """CPU: bytes per row task, to the nearest power of two; CUDA: 0 (every kernel alike).

    A CPU thread pool splits a parallel loop's tasks evenly by count, so members
    whose tasks differ in size would load the cores unevenly (a row of 768
    elements packed with single-element tasks: one core does the rows).
    """
    if plan.target != "cpu":
        return 0
    return round(math.log2(max(1, plan.ideal_bytes // max(1, plan.mapping.rows))))


def _path_masks(bindings: list) -> list:
    """Per binding, a bitmask of the bindings it depends on, directly or not."""
    index = {b.var: i for i, b in enumerate(bindings)}
    masks = []
    for i, binding in enumerate(bindings):
        mask = 0
        for var in relax.analysis.free_vars(binding.value):
            j = index.get(var)
            if j is not None:
                mask |= (1 << j) | masks[j]
        masks.append(mask)
    return masks


def pack_groups(bindings: list, kernels: dict) -> list:
    """The packs `pack_block` forms: lists of binding indices (two or more each) of independent
    packable kernel calls with one launch shape. `kernels` as for `pack_block`."""
    candidates = []
    for i, binding in enumerate(bindings):
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
            name = value.args[0].name_hint
            if name in kernels and packable(kernels[name][1]) and _one_task_loop(kernels[name][0]):
                candidates.append(i)
    if len(candidates) < 2:
        return []
    depends = _path_masks(bindings)
    packs: list = []
    for i in candidates:
        name = bindings[i].value.args[0].name_hint
        plan = kernels[name][1]
        signature = (plan.target, plan.scheme == "column-split", plan.mapping.threads, plan.mapping.rows_per_task,
                     _task_size(plan), loop_signature(kernels[name][0]))
        for group in packs:
            if group["signature"] != signature or len(group["members"]) >= MAX_PACK:
                continue
            if any(depends[i] >> j & 1 or depends[j] >> i & 1 for j in group["members"]):
                continue
            group["members"].append(i)
            break
        else:
            packs.append({"signature": signature, "members": [i]})
    return [g["members"] for g in packs if len(g["members"]) > 1]


def _saved(packs: list) -> int:
    """Launches that packs save: one fewer than its members, per pack."""
    return sum(len(members) - 1 for members in packs)


def packed_kernels(bindings: list, kernels: dict, walks: dict) -> tuple:
    """(name -> (PrimFunc, plan) of the kernels to pack, names of the kernels replaced by their walk).

    `kernels` and `walks`: name -> (PrimFunc, plan), a walk being the thread-per-column plan of a
    one-launch column-split kernel. Where packing the walks saves more launches than packing the
    column-split kernels (with those of their block shape), each column-split kernel that the walks'
    packs take is replaced by its walk: launch counts never rise for the threads gained."""
    trial = {name: walks.get(name, kernel) for name, kernel in kernels.items()}
    walk_packs = pack_groups(bindings, trial)
    if _saved(walk_packs) <= _saved(pack_groups(bindings, kernels)):
        return kernels, ()
    packed = {bindings[i].value.args[0].name_hint for members in walk_packs for i in members}
    taken = tuple(sorted(packed & set(walks)))
    return {name: walks[name] if name in taken else kernel for name, kernel in kernels.items()}, taken


def pack_block(bindings: list, kernels: dict, calls, recorded: list, verify, keep=None) -> list:
    """`bindings` with independent packable kernel calls merged into packed calls.

    `kernels` maps a stitched kernel's name to (PrimFunc, plan); `calls` gives
    (and creates) GlobalVars by name; `verify(func)` raises if a packed kernel
    does not build; `keep(func, plans)` (optional) says whether a packed kernel
    is worth its members apart (one it refuses leaves them unpacked); each pack
    is appended to `recorded` as (packed kernel, member kernels).
    """
    packs, built = [], []
    for members in pack_groups(bindings, kernels):
        names = [bindings[i].value.args[0].name_hint for i in members]
        n_outputs = [len(_out_types(bindings[i].value)) for i in members]
        func = pack([kernels[n][0] for n in names], n_outputs)
        verify(func)
        if keep is None or keep(func, [kernels[n][1] for n in names]):
            packs.append(members)
            built.append((names, func))
    if not packs:
        return bindings
    return _rewrite(bindings, packs, dict(enumerate(built)), calls, recorded, _path_masks(bindings))


def _rewrite(bindings: list, packs: list, built: dict, calls, recorded: list, depends: list) -> list:
    member_of = {i: k for k, members in enumerate(packs) for i in members}
    emitted_pack = set()
    out = []
    done = 0  # bitmask of emitted original bindings
    pending = list(range(len(bindings)))
    # Emit in an order where every pack comes after all its members' inputs.
    while pending:
        progress = False
        for i in list(pending):
            k = member_of.get(i)
            group = packs[k] if k is not None else [i]
            needed = 0
            for j in group:
                needed |= depends[j]
            needed &= ~sum(1 << j for j in group)
            if needed & ~done:
                continue
            if k is not None and k not in emitted_pack:
                out.extend(_packed_call(bindings, group, built[k], calls, recorded))
                emitted_pack.add(k)
            elif k is None:
                out.append(bindings[i])
            for j in group:
                done |= 1 << j
                if j in pending:
                    pending.remove(j)
            progress = True
            break
        if not progress:
            raise RuntimeError("internal error: packing created a cycle")
    return out


def _packed_call(bindings: list, group: list, built: tuple, calls, recorded: list) -> list:
    names, func = built
    gv = calls.add("pack_" + "_".join(n.split("_")[1] for n in names)[:40], func)
    args, out_types, outputs = [], [], []
    for i in group:
        call = bindings[i].value
        call_args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
        args.extend(call_args)
        ty = call.ty_args[0]
        out_types.extend(_out_types(call))
        outputs.append((bindings[i].var, ty))
    recorded.append((gv.name_hint, tuple(names)))
    tmp = relax.DataflowVar(f"{gv.name_hint}_out", relax.TupleType(out_types))
    new = [relax.VarBinding(tmp, relax.call_tir(gv, relax.Tuple(args), out_types))]
    k = 0
    for var, ty in outputs:
        if isinstance(ty, relax.TupleType):
            items = []
            for _ in ty.fields:
                items.append(relax.TupleGetItem(tmp, k))
                k += 1
            new.append(relax.VarBinding(var, relax.Tuple(items)))
        else:
            new.append(relax.VarBinding(var, relax.TupleGetItem(tmp, k)))
            k += 1
    return new


def _out_types(call: relax.Call) -> list:
    ty = call.ty_args[0]
    return list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
