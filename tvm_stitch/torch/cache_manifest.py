"""A disk cache entry's manifest: what its library was built from, and the check a library passes before loading.

An entry is a directory `<key>/` holding `lib.so` (the executable,
`export_library`) and `manifest.json`: the key, the target, the versions
of tvm-stitch, TVM and tvm-ffi (with a SHA-256 of tvm-stitch's installed
files, as an editable install keeps its version number while its code
changes) and the SHA-256 and size of `lib.so`. A library is loaded only
when its manifest names the key and target asked for, the running
versions, and the library's bytes hash to the manifest's SHA-256: a
truncated, empty, swapped, foreign or stale entry fails the check and is
rebuilt, never handed to `load_module`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
from dataclasses import asdict, dataclass

LIBRARY = "lib.so"
MANIFEST = "manifest.json"
FORMAT = 1  # the manifest's layout; an entry of another format is rebuilt


@dataclass(frozen=True)
class Versions:
    """The software a build depends on; part of every key and every manifest."""

    tvm_stitch: str
    tvm_stitch_files: str  # SHA-256 of the tvm_stitch and schedules packages' files
    tvm: str
    tvm_ffi: str


def current_versions() -> Versions:
    """The running process's versions (reads the packages' files: call once per cache)."""
    import tvm
    import tvm_ffi

    try:
        own = importlib.metadata.version("tvm-stitch")
    except importlib.metadata.PackageNotFoundError:
        own = "not installed"
    return Versions(own, _package_files_digest(("tvm_stitch", "schedules")), tvm.__version__, tvm_ffi.__version__)


def _package_files_digest(packages) -> str:
    digest = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        root = pathlib.Path(spec.origin).parent
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(f"{package}/{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(entry: str, key: str, target: str, versions: Versions) -> None:
    """Writes `entry`'s manifest for the library already in it."""
    library = os.path.join(entry, LIBRARY)
    manifest = {"format": FORMAT, "key": key, "target": target, "versions": asdict(versions),
                "sha256": file_digest(library), "size": os.path.getsize(library)}
    path = os.path.join(entry, MANIFEST)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1)
    os.chmod(path, 0o600)


def read_manifest(entry: str) -> dict | None:
    """`entry`'s manifest, or None where it is missing or not a manifest."""
    try:
        with open(os.path.join(entry, MANIFEST), encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def entry_problem(entry: str, key: str, versions: Versions, target: str | None = None) -> str | None:
    """Why the library in `entry` must not be loaded for `key` (and `target`, where given), or None."""
    manifest = read_manifest(entry)
    if manifest is None or manifest.get("format") != FORMAT:
        return "its manifest is missing or unreadable"
    if manifest.get("key") != key:
        return f"its manifest is for key {str(manifest.get('key'))[:16]}"
    if target is not None and manifest.get("target") != target:
        return f"its manifest is for target {manifest.get('target')!r}"
    if manifest.get("versions") != asdict(versions):
        return f"it was built by other versions ({_version_difference(manifest.get('versions'), versions)})"
    library = os.path.join(entry, LIBRARY)
    try:
        size, sha256 = os.path.getsize(library), file_digest(library)
    except OSError as err:
        return f"its library cannot be read ({err.strerror})"
    if size != manifest.get("size"):
        return f"its library has {size} bytes, its manifest says {manifest.get('size')}"
    if sha256 != manifest.get("sha256"):
        return "its library's SHA-256 is not its manifest's"
    return None


def _version_difference(recorded, versions: Versions) -> str:
    recorded = recorded if isinstance(recorded, dict) else {}
    differ = [f"{name} {recorded.get(name)!s:.16}, this process {value:.16}" for name, value in asdict(versions).items()
              if recorded.get(name) != value]
    return ", ".join(differ)
