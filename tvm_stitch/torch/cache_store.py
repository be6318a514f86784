"""The disk cache's store: entries published atomically, checked before loading, left alone when not trusted.

The directory is checked (made 0700 where missing) at first use; one
that cannot be made, is not a directory, or is not trusted (cache_trust)
gives one CacheWarning and the cache runs in memory only. An entry is
written in a private staging directory (`.<key prefix>-<random>`, 0700):
the library, then its manifest; the staging directory is then renamed
to `<key>` in one step, so a reader sees a whole entry or none. Where two
processes publish one key, the second finds the first's entry valid and
drops its own; an entry that failed its check is moved aside and
replaced. Before loading, an entry is checked for trust (refused: one
warning, the build stays in memory and the entry is left as it is) and
against its manifest (cache_manifest; a failing entry is rebuilt).
`load_module` sees only a library that passed both.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import uuid
import warnings

import tvm

from tvm_stitch.torch.cache_manifest import LIBRARY, MANIFEST, Versions, entry_problem, write_manifest
from tvm_stitch.torch.cache_trust import entry_trust_problem, prepare_directory

CACHE_DIR_VARIABLE = "TVM_STITCH_CACHE_DIR"
KEY = re.compile(r"[0-9a-f]{64}")
LEFTOVER = re.compile(r"\.[0-9a-f]{16}-.+|[0-9a-f]{64}\.so")  # staging or set aside; the layout before entries
PUBLISH_TRIES = 3  # renames of a finished entry into place before leaving the key to the other writers


class CacheWarning(UserWarning):
    """The disk cache (or one entry of it) was not used; the build runs all the same."""


def entry_paths(entry: str) -> tuple:
    """The entry directory and the files in it."""
    return entry, os.path.join(entry, LIBRARY), os.path.join(entry, MANIFEST)


def remove(path: str) -> None:
    """Removes a file or directory tree (gone already: nothing to do)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


class DiskStore:
    """Verified executables in `directory`, for one process's versions."""

    def __init__(self, directory: str, versions: Versions):
        self.directory = directory
        self.versions = versions
        self.problem = None  # None: not looked at yet; "": usable; else why the disk is skipped
        self.refused = set()  # keys whose entries are not trusted: built in memory, never replaced
        self.warned = set()  # keys whose entry this process has warned of: one warning per entry

    def load(self, key: str, target: str):
        """The executable of `key`'s entry where it is trusted and passes its check; else None."""
        if not self._usable():
            return None
        entry = os.path.join(self.directory, key)
        if not os.path.lexists(entry):
            return None
        problem = entry_trust_problem(entry_paths(entry))
        if problem is not None:
            self.refused.add(key)
            self._warn_entry(key, f"entry {key[:16]} of the compile cache {self.directory} is refused: {problem}; "
                       "built in memory")
            return None
        problem = entry_problem(entry, key, self.versions, target)
        if problem is not None:
            self._warn_entry(key, f"entry {key[:16]} of the compile cache {self.directory} is rebuilt: {problem}")
            return None
        try:
            return tvm.runtime.load_module(os.path.join(entry, LIBRARY))
        except Exception as err:  # noqa: BLE001 - a library the loader refuses is rebuilt, the process goes on
            self._warn_entry(key, f"entry {key[:16]} of the compile cache {self.directory} is rebuilt: it did not load "
                       f"({type(err).__name__})")
            return None

    def save(self, key: str, target: str, executable) -> None:
        """Publishes `executable` as `key`'s entry; where the disk cannot take it, one warning and no more tries."""
        if key in self.refused or not self._usable():
            return
        staging = None
        try:
            staging = tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=self.directory)
            executable.export_library(os.path.join(staging, LIBRARY))
            os.chmod(os.path.join(staging, LIBRARY), 0o600)
            write_manifest(staging, key, target, self.versions)
            self._publish(key, target, staging)
        except Exception as err:  # noqa: BLE001 - a cache that cannot be written: the build is kept, the disk skipped
            detail = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
            self.problem = f"cannot be written ({detail})"
            self._warn(f"the compile cache {self.directory} {self.problem}: builds are kept in memory only")
        finally:
            if staging is not None:
                remove(staging)

    def _publish(self, key: str, target: str, staging: str) -> None:
        entry = os.path.join(self.directory, key)
        for _ in range(PUBLISH_TRIES):
            try:
                os.rename(staging, entry)
                return
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
            if entry_trust_problem(entry_paths(entry)) is not None:
                return  # not ours to replace
            if entry_problem(entry, key, self.versions, target) is None:
                return  # another process published a valid entry first
            aside = os.path.join(self.directory, f".{key[:16]}-old-{uuid.uuid4().hex}")
            try:
                os.rename(entry, aside)
            except FileNotFoundError:
                continue  # another process set it aside first
            remove(aside)

    def _usable(self) -> bool:
        if self.problem is None:
            self.problem = prepare_directory(self.directory) or ""
            if self.problem:
                self._warn(f"the compile cache {self.directory} {self.problem}: builds are kept in memory only")
        return self.problem == ""

    def _warn_entry(self, key: str, text: str) -> None:
        """One warning per entry and process (a key looked up again, as a build claim does, says nothing more)."""
        if key not in self.warned:
            self.warned.add(key)
            self._warn(text)

    @staticmethod
    def _warn(text: str) -> None:
        warnings.warn(text, CacheWarning, stacklevel=4)
