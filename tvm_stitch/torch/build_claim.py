"""One build per graph for all the processes sharing a disk cache: the first to claim a key builds, the others wait.

The ranks of a torch.distributed job compile the same graphs at the same
time. With a shared `TVM_STITCH_CACHE_DIR`, the first process to create
`<key>.building` in it (`O_CREAT | O_EXCL`: atomic, no lock held) builds
and writes the executable (the cache writes it under a temporary name and
renames it into place: readers never see a partial library); the others
poll for the entry and load it. The claim is removed when its builder is
done, whether the build succeeded or not: a waiter that sees the claim gone
without an entry claims the key and builds itself (and meets the same error, which goes to
eager as usual). A claim left by a dead process on this host, or older
than STALE_SECONDS, is taken over.
"""

from __future__ import annotations

import os
import socket
import time

CLAIM_SUFFIX = ".building"
POLL_SECONDS = 0.05
STALE_SECONDS = 3600.0  # longer than any build: a claim this old was left by a process that died


class BuildClaim:
    """`with BuildClaim(cache, key, target) as claim:` then `claim.found`: (executable, "memory" | "disk") when
    the cache has the key or another process built it meanwhile, else (None, None): build and put it."""

    def __init__(self, cache, key: str, target):
        self.cache, self.key, self.target = cache, key, target
        self.path = None  # the claim file, while this process holds it
        self.found = (None, None)

    def __enter__(self) -> BuildClaim:
        if self.cache is None:
            return self
        self.found = self.cache.get(self.key, self.target)
        disk = self.cache.disk
        if self.found[0] is None and disk is not None and disk.problem == "":  # a trusted, usable directory
            self.found = self._claim_or_wait(os.path.join(disk.directory, self.key + CLAIM_SUFFIX))
        return self

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            _remove(self.path)
            self.path = None

    def _claim_or_wait(self, path: str) -> tuple:
        while True:
            claimed = _create(path)
            if claimed is None:
                return None, None
            if claimed:
                self.path = path
                return self.cache.get(self.key, self.target)  # built by another process between the look-up and the claim
            if _stale(path):
                _remove(path)
                continue
            found = self.cache.get(self.key, self.target)
            if found[0] is not None:
                return found
            time.sleep(POLL_SECONDS)


def _owner() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def _create(path: str) -> bool | None:
    """True: claimed; False: another process holds the claim; None: no claim can be made there (a directory
    this process cannot write: the build goes on unclaimed, and the cache says why it keeps it in memory)."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    except OSError:
        return None
    with os.fdopen(descriptor, "w") as claim:
        claim.write(_owner())
    return True


def _stale(path: str) -> bool:
    """Whether the claim's builder is gone: a dead process of this host, or a claim older than STALE_SECONDS."""
    try:
        with open(path) as claim:
            host, _, pid = claim.read().partition(" ")
        age = time.time() - os.path.getmtime(path)
    except (OSError, ValueError):
        return False  # removed meanwhile, or still being written
    if age > STALE_SECONDS:
        return True
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
