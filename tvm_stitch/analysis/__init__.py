"""What each PrimFunc of a FuseOps group is: TIR views, op classes, row alignment, the block graph."""
