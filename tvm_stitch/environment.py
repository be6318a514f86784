"""Environment variables set for the length of a block (a child build's or child process's settings)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def environment_set(values: dict):
    """Set `values` in os.environ inside the block; each variable's earlier value (or its absence) after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
