"""The reasons a graph, or part of one, is not built on TVM and runs on PyTorch eager instead."""

from __future__ import annotations


class CannotBuild(Exception):
    """Base of every reason; `op` and `where` name the node and module concerned where one is."""

    def __init__(self, message: str, op: str = "", where: str = ""):
        super().__init__(message)
        self.op, self.where = op, where


class UnsupportedGraph(CannotBuild, ValueError):
    """The graph has something TVM's importer cannot take."""


class UnsupportedSize(CannotBuild, ValueError):
    """A symbolic size with no TIR form here."""


class UnsupportedDevice(CannotBuild, ValueError):
    """Tensors on a device tvm-stitch builds for neither, or a target for another device."""


class BuildFailed(CannotBuild, RuntimeError):
    """The pipeline or TVM's build raised on an imported graph."""
