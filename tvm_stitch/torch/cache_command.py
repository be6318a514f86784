"""`tvm-stitch cache show|verify|clear`: the disk compile cache's entries, their checks, their removal.

`show` lists the entries (key, size, target, whether built by other
versions); `verify` runs on each the check loading runs (trust, manifest,
SHA-256 of the library) and exits 1 where one fails; `clear` removes the
entries and leftovers of interrupted writes (with `--invalid`, only the
entries that fail the check), never other files, and never in a directory
that is not trusted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

from tvm_stitch.torch.cache_manifest import LIBRARY, current_versions, entry_problem, read_manifest
from tvm_stitch.torch.cache_store import CACHE_DIR_VARIABLE, KEY, LEFTOVER, entry_paths, remove
from tvm_stitch.torch.cache_trust import directory_problem, entry_trust_problem

ACTIONS = ("show", "verify", "clear")


def cache_command(action: str, directory: str, invalid: bool = False) -> int:
    """Runs `action` on the cache in `directory` (empty: TVM_STITCH_CACHE_DIR); the exit status."""
    directory = directory or os.environ.get(CACHE_DIR_VARIABLE, "")
    usage = _usage_problem(action, directory, invalid)
    if usage is not None:
        print(usage, file=sys.stderr)
        return 2
    if not os.path.lexists(directory):
        print(f"no compile cache at {directory} (nothing built there yet)")
        return 0
    problem = directory_problem(directory)
    if problem == "is not a directory" or (problem is not None and action == "clear"):
        print(f"the compile cache {directory} {problem}: not {'cleared' if action == 'clear' else 'read'}",
              file=sys.stderr)
        return 2
    try:
        return {"show": _show, "verify": _verify, "clear": _clear}[action](directory, problem, invalid)
    except OSError as err:
        print(f"the compile cache {directory} cannot be read ({err.strerror})", file=sys.stderr)
        return 2


def _usage_problem(action: str, directory: str, invalid: bool) -> str | None:
    if action not in ACTIONS:
        return f"unknown cache action {action!r}; actions: {', '.join(ACTIONS)}"
    if invalid and action != "clear":
        return "--invalid goes with clear only"
    if not directory:
        return f"no cache directory: give --dir or set {CACHE_DIR_VARIABLE}"
    return None


def _names(directory: str) -> tuple:
    """(entry keys, leftovers of interrupted writes), sorted."""
    names = sorted(os.listdir(directory))
    return [n for n in names if KEY.fullmatch(n)], [n for n in names if LEFTOVER.fullmatch(n)]


def _header(directory: str, problem: str | None, keys: list, leftovers: list) -> str:
    state = f"refused: it {problem}" if problem else "trusted"
    extra = f", {len(leftovers)} leftover(s) of interrupted writes" if leftovers else ""
    return f"compile cache {directory} ({state}): {len(keys)} entr{'y' if len(keys) == 1 else 'ies'}{extra}"


def _show(directory: str, problem: str | None, _invalid: bool) -> int:
    keys, leftovers = _names(directory)
    print(_header(directory, problem, keys, leftovers))
    versions = asdict(current_versions())
    for key in keys:
        manifest = read_manifest(os.path.join(directory, key)) or {}
        library = os.path.join(directory, key, LIBRARY)
        size = os.path.getsize(library) if os.path.isfile(library) else 0
        stale = " (built by other versions)" if manifest and manifest.get("versions") != versions else ""
        print(f"  {key[:16]}  {size / 1024:8.1f} KiB  {manifest.get('target', '(no manifest)')}{stale}")
    return 0


def _check(directory: str, key: str, versions) -> str | None:
    """Why `key`'s entry would not be loaded, or None."""
    entry = os.path.join(directory, key)
    problem = entry_trust_problem(entry_paths(entry))
    if problem is not None:
        return f"refused: {problem}"
    return entry_problem(entry, key, versions)


def _verify(directory: str, problem: str | None, _invalid: bool) -> int:
    keys, leftovers = _names(directory)
    print(_header(directory, problem, keys, leftovers))
    versions = current_versions()
    failing = 0
    for key in keys:
        reason = _check(directory, key, versions)
        failing += reason is not None
        print(f"  {key[:16]}  {'ok' if reason is None else 'not loaded: ' + reason}")
    print(f"{len(keys) - failing} of {len(keys)} entries pass the check loading runs")
    return 0 if problem is None and not failing else 1


def _clear(directory: str, _problem: str | None, invalid: bool) -> int:
    keys, leftovers = _names(directory)
    if invalid:
        versions = current_versions()
        keys = [k for k in keys if _check(directory, k, versions) is not None]
    failed = []
    for name in keys + leftovers:
        try:
            remove(os.path.join(directory, name))
        except OSError as err:
            failed.append(f"{name[:16]} ({err.strerror})")
    print(f"removed {len(keys) + len(leftovers) - len(failed)} of {len(keys) + len(leftovers)} "
          f"({len(keys)} {'failing ' if invalid else ''}entries, {len(leftovers)} leftovers) from {directory}")
    if failed:
        print(f"could not remove: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
