"""Whether a cache directory and its entries may be trusted: owned by this user and writable by no one else.

A library from the cache runs its code in this process, so, as compilers'
caches do (ccache, Inductor's per-user directories), a directory or entry
another user owns, or one that group or others may write (where anyone
could plant a library), is refused. A directory the cache creates is
made with mode 0700.
"""

from __future__ import annotations

import os
import stat


def prepare_directory(path: str) -> str | None:
    """Creates `path` (mode 0700) where nothing is there; why it cannot be the cache, or None when it can."""
    if not os.path.lexists(path):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # the umask may have taken bits away: the owner needs all three
        except FileExistsError:
            pass  # made by another process meanwhile: checked below like any other
        except OSError as err:
            return f"cannot be created ({err.strerror})"
    return directory_problem(path)


def directory_problem(path: str) -> str | None:
    """Why the existing `path` is not a directory this user may trust as the cache, or None."""
    try:
        status = os.stat(path)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not stat.S_ISDIR(status.st_mode):
        return "is not a directory"
    return ownership_problem(status)


def entry_trust_problem(paths) -> str | None:
    """Why an entry (its directory and files: `paths`, those missing skipped) is not to be trusted, or None."""
    for path in paths:
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            return f"{os.path.basename(path)} cannot be read ({err.strerror})"
        if stat.S_ISLNK(status.st_mode):
            return f"{os.path.basename(path)} is a symbolic link"
        problem = ownership_problem(status)
        if problem is not None:
            return f"{os.path.basename(path)} {problem}"
    return None


def ownership_problem(status: os.stat_result) -> str | None:
    """Why a file or directory with `status` is not this user's alone, or None."""
    if status.st_uid != os.geteuid():
        return f"is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(status.st_mode):o})"
    return None
