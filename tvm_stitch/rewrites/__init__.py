"""The Relax rewrites the pipeline runs before grouping: attention chains and accumulating scatters as planned
kernels, closed forms of symbolic sizes, host constants, precision, fast math, patchifying convolutions, and the
matmul boundaries (prologues folded in, epilogues relabelled)."""
