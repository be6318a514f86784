"""TIR as text, edited and parsed again: test material for kernels run under the SIMT checker (light to
import: no tensor intrinsics registered)."""

from __future__ import annotations

import re

import tvm


def with_static_shared(func):
    """`func` with its dynamic shared memory (`shared.dyn`) declared static (`shared`): the SIMT checker's
    launch geometry takes static shared memory only."""
    return reparsed(func.script().replace('"shared.dyn"', '"shared"'))


def reparsed(text: str):
    # TVMScript prints mma_fill/mma_store without the dtype its parser requires (float32 accumulators here)
    text = re.sub(r"(T\.cuda\.mma_(?:fill|store)_legacy\(.*)\)$", r'\1, dtype="float32")', text, flags=re.M)
    return tvm.script.from_source(text)
