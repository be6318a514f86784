"""TVM's OpPatternKind values, as the `op_pattern` attribute of a PrimFunc holds them (FuseOps reads them)."""

ELEMWISE, BROADCAST, INJECTIVE, OUT_EWISE_FUSABLE, OPAQUE = 0, 1, 2, 4, 8
