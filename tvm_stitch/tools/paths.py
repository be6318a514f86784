"""Checks that a path given on the command line can be written, made before the work it ends."""

from __future__ import annotations

import os
import tempfile

from tvm_stitch.errors import UserInputError


def check_writable_file(path: str, option: str, makes_folders: bool = False) -> None:
    """UserInputError naming `option` unless a file can be written at `path` (its folder must exist
    unless the writer `makes_folders`). Leaves nothing behind."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UserInputError(f"{option} {path}: is a folder, not a file")
    folder = os.path.dirname(full)
    if not makes_folders and not os.path.isdir(folder):
        raise UserInputError(f"{option} {path}: there is no folder {folder}")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise UserInputError(f"{option} {path}: the file is not writable")
    _probe(folder, option, path)


def check_writable_folder(path: str, option: str) -> None:
    """UserInputError naming `option` unless the folder `path` exists and is writable or can be made.
    Leaves nothing behind (a missing folder is not made here)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise UserInputError(f"{option} {path}: is a file, not a folder")
    _probe(full, option, path)


def _probe(folder: str, option: str, path: str) -> None:
    """Create and delete a temporary file in `folder`, or in its nearest existing parent."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserInputError(f"{option} {path}: {existing} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise UserInputError(f"{option} {path}: cannot write in {existing} ({err.strerror})") from err
