"""Errors that blame what the user gave (a target, a file, a name), not tvm-stitch."""

from __future__ import annotations


class UserInputError(ValueError):
    """What the user gave is wrong; the message names it and what is accepted. The command line
    prints it as one line and exits 2 (a bug in tvm-stitch keeps its traceback)."""


class TargetError(UserInputError):
    """A target tvm-stitch cannot plan for: an unsupported kind, a malformed CUDA arch, a CPU name
    LLVM does not know."""
