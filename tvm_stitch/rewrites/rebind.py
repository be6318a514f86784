"""A module's Relax functions rewritten by a mutator (`each_function`, the body of the Relax rewrite passes),
and chosen bindings bound to new values (a planned kernel's call), the bindings nothing reads any more
dropped: the rewrite FuseAttention and ScatterAddsAtomically share (`rebound`)."""

from __future__ import annotations

import tvm
from tvm import relax


@relax.expr_functor.mutator
class _Rebinder(relax.PyExprMutator):
    """Binds each var of `replaced` to `value(mutator, binding, replaced[var])`; the rest as it was."""

    def __init__(self, mod: tvm.IRModule, replaced: dict, value):
        super().__init__(mod)
        self.replaced, self.value = replaced, value

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.replaced:
            super().visit_var_binding_(binding)
            return
        new = self.value(self, binding, self.replaced[binding.var])
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(new)))


def rebound(builder: relax.BlockBuilder, replaced: dict, value) -> tvm.IRModule:
    """The builder's module (its kernels added) with every Relax function's bindings of `replaced` (var ->
    what `value` needs) bound to `value(mutator, binding, entry)`, an expression it may emit bindings
    for through `mutator.builder_` and `mutator.visit_expr`; unused bindings removed."""
    module = builder.get()
    return each_function(_Rebinder(module, replaced, value), module, relax.analysis.remove_all_unused)


def each_function(mutator: relax.PyExprMutator, module: tvm.IRModule, tidy=None) -> tvm.IRModule:
    """`module` with each Relax function visited by `mutator` (made over `module`), `tidy` applied to
    what it gives (None: nothing)."""
    for gv, func in list(module.functions_items()):
        if isinstance(func, relax.Function):
            new = mutator.visit_expr(func)
            mutator.builder_.update_func(gv, tidy(new) if tidy is not None else new)
    return mutator.builder_.get()
