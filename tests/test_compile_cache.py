"""The disk compile cache as a trusted store: what is planted, damaged, swapped, stale or foreign is never loaded."""

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

import tvm_stitch.torch as ts  # noqa: E402
from tvm_stitch.torch.cache_manifest import LIBRARY, MANIFEST, current_versions, entry_problem  # noqa: E402
from tvm_stitch.torch import CacheWarning  # noqa: E402
from tvm_stitch.tools.cli import main  # noqa: E402

OTHER_UID = 65534  # nobody
X = torch.randn(4, 8)


def _softmax():
    return torch.nn.Softmax(dim=-1)


def _relu():
    return torch.nn.ReLU()


MODELS = {"softmax": _softmax, "relu": _relu}


def _run(backend, name):
    """The compiled model's answer on X, checked against eager; the backend's counters tell where it came from."""
    torch._dynamo.reset()  # else dynamo serves its own earlier build and never asks the backend
    model = MODELS[name]()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(X)
        torch.testing.assert_close(out, model(X))


def _entries(directory):
    return sorted(p for p in os.listdir(directory) if not p.startswith("."))


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache holding the softmax's and the relu's entries: {name: key}."""
    directory = tmp_path_factory.mktemp("warm") / "cache"
    keys = {}
    for name in MODELS:
        before = set(_entries(directory)) if directory.exists() else set()
        backend = ts.backend(cache=str(directory))
        _run(backend, name)
        assert backend.counters.compiles == 1, backend.counters
        (keys[name],) = set(_entries(directory)) - before
    return directory, keys


@pytest.fixture
def cache(warm, tmp_path):
    """A copy of the warm cache for one test: (directory, keys)."""
    directory = tmp_path / "cache"
    shutil.copytree(warm[0], directory)
    return directory, warm[1]


def _fresh(directory):
    """A backend on `directory`, as a later process has it (nothing in memory)."""
    return ts.backend(cache=str(directory))


def _cache_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, CacheWarning)]


def _planted_library(tmp_path):
    """A shared library whose constructor writes a marker file: (library, marker)."""
    marker, source, library = tmp_path / "ran", tmp_path / "planted.c", tmp_path / "planted.so"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                      f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library, marker


def _plant(entry, library):
    """`library` as the entry's lib.so, with a manifest rewritten to match it (as a forger would)."""
    shutil.copy(library, entry / LIBRARY)
    manifest = json.loads((entry / MANIFEST).read_text())
    data = (entry / LIBRARY).read_bytes()
    manifest.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (entry / MANIFEST).write_text(json.dumps(manifest))


def test_a_warm_cache_is_loaded_and_its_entries_are_private(cache):
    directory, keys = cache
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    for key in keys.values():
        assert entry_problem(str(directory / key), key, current_versions()) is None
        for path in (directory / key, directory / key / LIBRARY, directory / key / MANIFEST):
            assert os.stat(path).st_mode & 0o077 == 0, path
    backend = _fresh(directory)
    _run(backend, "softmax")
    assert (backend.counters.compiles, backend.counters.disk_hits) == (0, 1), backend.counters


def test_the_directory_is_made_0700_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        backend = _fresh(tmp_path / "made" / "cache")
        _run(backend, "relu")
    finally:
        os.umask(old)
    (entry,) = (tmp_path / "made" / "cache").iterdir()
    assert os.stat(tmp_path / "made" / "cache").st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in (entry, entry / LIBRARY, entry / MANIFEST)} == {0o700, 0o600}


@pytest.mark.parametrize("how", ["replaced library", "foreign owner", "group-writable", "others-writable file"])
def test_a_planted_entry_is_never_loaded(cache, tmp_path, how):
    """A library with a constructor, planted in an entry: its constructor never runs, the answer is right."""
    directory, keys = cache
    library, marker = _planted_library(tmp_path)
    entry = directory / keys["softmax"]
    if how == "replaced library":
        shutil.copy(library, entry / LIBRARY)  # the manifest still names the real library
    else:
        _plant(entry, library)
    if how == "foreign owner":
        for path in (entry, entry / LIBRARY, entry / MANIFEST):
            os.chown(path, OTHER_UID, OTHER_UID)
    elif how == "group-writable":
        os.chmod(entry, 0o770)
    elif how == "others-writable file":
        os.chmod(entry / LIBRARY, 0o602)
    backend = _fresh(directory)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(backend, "softmax")
        _run(backend, "softmax")
    assert not marker.exists(), "the planted library was loaded"
    assert (backend.counters.compiles, backend.counters.disk_hits, backend.counters.eager_fallbacks) == (1, 0, 0)
    (warning,) = _cache_warnings(record)
    assert keys["softmax"][:16] in warning
    if how != "replaced library":  # refused: left as found, the build kept in memory
        assert "refused" in warning and (entry / LIBRARY).read_bytes() == library.read_bytes()
    else:  # failed its check: rebuilt in place
        assert "rebuilt" in warning and entry_problem(str(entry), keys["softmax"], current_versions()) is None
    ctypes.CDLL(str(library))  # the marker works: loading the planted library would have written it
    assert marker.exists()


@pytest.mark.parametrize("how", ["foreign owner", "group-writable"])
def test_a_directory_not_this_users_alone_is_never_read_or_written(cache, tmp_path, how):
    directory, keys = cache
    library, marker = _planted_library(tmp_path)
    _plant(directory / keys["softmax"], library)
    if how == "foreign owner":
        os.chown(directory, OTHER_UID, OTHER_UID)
    else:
        os.chmod(directory, 0o775)
    backend = _fresh(directory)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(backend, "softmax")
        _run(backend, "relu")
    assert not marker.exists()
    assert (backend.counters.compiles, backend.counters.disk_hits) == (2, 0), backend.counters
    (warning,) = _cache_warnings(record)
    assert "in memory only" in warning and ("uid 65534" in warning if how == "foreign owner" else "775" in warning)
    assert not [p for p in os.listdir(directory) if p.startswith(".")], "nothing written there"


def _target_of(entry):
    return json.loads((entry / MANIFEST).read_text())["target"]


def _truncate(entry):
    data = (entry / LIBRARY).read_bytes()
    (entry / LIBRARY).write_bytes(data[:len(data) // 2])


def _empty(entry):
    (entry / LIBRARY).write_bytes(b"")


def _stale(entry):
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["versions"]["tvm_stitch"] = "0.0.1"
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _other_target(entry):
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["target"] = "cuda -arch=sm_80"
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _no_manifest(entry):
    (entry / MANIFEST).unlink()


@pytest.mark.parametrize("damage", [_truncate, _empty, _stale, _other_target, _no_manifest])
def test_a_damaged_or_stale_entry_is_rebuilt_and_the_answer_is_right(cache, damage):
    directory, keys = cache
    entry = directory / keys["softmax"]
    target = _target_of(entry)
    damage(entry)
    assert entry_problem(str(entry), keys["softmax"], current_versions(), target) is not None
    backend = _fresh(directory)
    with pytest.warns(CacheWarning, match="rebuilt"):
        _run(backend, "softmax")
    assert (backend.counters.compiles, backend.counters.disk_hits) == (1, 0), backend.counters
    assert entry_problem(str(entry), keys["softmax"], current_versions(), target) is None, "replaced by a valid entry"
    later = _fresh(directory)
    _run(later, "softmax")
    assert (later.counters.compiles, later.counters.disk_hits) == (0, 1), later.counters


@pytest.mark.parametrize("swap", ["libraries", "entries"])
def test_swapped_entries_are_rebuilt_and_the_answers_are_right(cache, swap):
    """Softmax's and relu's libraries (or whole entries) exchanged: the SHA-256 (or the key) in the manifest
    catches it; loaded, relu's library would answer for softmax."""
    directory, keys = cache
    a, b = directory / keys["softmax"], directory / keys["relu"]
    first, second = (a / LIBRARY, b / LIBRARY) if swap == "libraries" else (a, b)
    first.rename(directory / "swap")
    second.rename(first)
    (directory / "swap").rename(second)
    backend = _fresh(directory)
    with pytest.warns(CacheWarning, match="rebuilt"):
        _run(backend, "softmax")
        _run(backend, "relu")
    assert (backend.counters.compiles, backend.counters.disk_hits) == (2, 0), backend.counters


def test_the_versions_are_in_the_key(cache):
    directory, keys = cache
    backend = _fresh(directory)
    backend.cache.versions = replace(backend.cache.versions, tvm="0.28.0")
    backend.cache.disk.versions = backend.cache.versions
    _run(backend, "softmax")
    assert (backend.counters.compiles, backend.counters.disk_hits) == (1, 0), backend.counters
    assert len(_entries(directory)) == 3, "a new entry beside the old one"


@pytest.mark.parametrize("where", ["a file", "below a file", "not creatable", "not writable"])
def test_an_unusable_cache_path_keeps_the_build_on_tvm(tmp_path, where):
    (tmp_path / "file").write_text("")
    path = {"a file": tmp_path / "file", "below a file": tmp_path / "file" / "cache",
            "not creatable": "/sys/tvm-stitch-cache", "not writable": "/sys/fs"}[where]
    if where.startswith("not") and not os.path.isdir("/sys/fs"):
        pytest.skip("no sysfs here: no directory even root cannot write")
    backend = _fresh(path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(backend, "softmax")
        _run(backend, "relu")
        _run(backend, "softmax")
    assert (backend.counters.compiles, backend.counters.cache_hits, backend.counters.eager_fallbacks) == (2, 1, 0)
    (warning,) = _cache_warnings(record)
    assert "in memory only" in warning
    assert (tmp_path / "file").read_text() == ""


CHILD = """
import os, sys, time, torch, tvm_stitch.torch as ts
backend = ts.backend(cache=sys.argv[1])
open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
while not os.path.exists(os.path.join(sys.argv[2], "go")):  # both processes imported: they build at once
    time.sleep(0.01)
with torch.no_grad():
    model = torch.nn.Softmax(dim=-1)
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
print(backend.counters.compiles, backend.counters.disk_hits)
"""


def test_two_processes_filling_one_cache_at_once_end_with_one_valid_entry(tmp_path):
    directory, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(barrier)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    while len(os.listdir(barrier)) < 2 and all(c.poll() is None for c in children):
        time.sleep(0.01)
    (barrier / "go").touch()
    counts = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-2000:]
        counts.append(tuple(int(n) for n in out.split()[-2:]))
    assert all(sum(c) == 1 for c in counts), counts  # each built or loaded once
    (key,) = os.listdir(directory)  # one entry, no staging left behind
    assert entry_problem(str(directory / key), key, current_versions()) is None
    later = _fresh(directory)
    _run(later, "softmax")
    assert (later.counters.compiles, later.counters.disk_hits) == (0, 1), later.counters


def test_a_second_writer_keeps_the_first_writers_entry(cache, tmp_path):
    """Two processes built one graph; the second to publish finds a valid entry there and drops its own."""
    from tvm_stitch.torch.cache_store import DiskStore

    directory, keys = cache
    entry = directory / keys["softmax"]
    inode = os.stat(entry / LIBRARY).st_ino
    other = _fresh(tmp_path / "other")
    _run(other, "softmax")
    target = _target_of(entry)
    DiskStore(str(directory), current_versions()).save(keys["softmax"], target, other.cache.memory[keys["softmax"]])
    assert os.stat(entry / LIBRARY).st_ino == inode
    assert sorted(os.listdir(directory)) == sorted(keys.values()), "the second build is dropped, not left behind"


def test_the_cache_command_shows_verifies_and_clears(cache, capsys, monkeypatch):
    directory, keys = cache
    assert main(["cache", "show", "--dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "(trusted): 2 entries" in out and keys["relu"][:16] in out and keys["softmax"][:16] in out
    assert main(["cache", "verify", "--dir", str(directory)]) == 0
    assert "2 of 2 entries pass" in capsys.readouterr().out
    _truncate(directory / keys["relu"])
    os.mkdir(directory / f".{keys['relu'][:16]}-abc")  # left by an interrupted write
    monkeypatch.setenv("TVM_STITCH_CACHE_DIR", str(directory))
    assert main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 entries pass" in out and "1 leftover(s)" in out and "its library has" in out
    assert main(["cache", "clear", "--invalid"]) == 0
    assert _entries(directory) == [keys["softmax"]] and len(os.listdir(directory)) == 1
    assert main(["cache", "clear"]) == 0
    assert os.listdir(directory) == []
    capsys.readouterr()


@pytest.mark.parametrize("argv, says", [
    (["cache", "list"], "unknown cache action 'list'"),
    (["cache", "show", "--invalid"], "--invalid goes with clear only"),
    (["cache", "show"], "no cache directory"),
    (["cache", "verify", "--dir", "{file}"], "is not a directory"),
    (["cache", "clear", "--dir", "{foreign}"], "is owned by uid 65534"),
])
def test_the_cache_command_answers_a_bad_argument_with_one_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.delenv("TVM_STITCH_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("")
    (tmp_path / "foreign").mkdir(mode=0o700)
    os.chown(tmp_path / "foreign", OTHER_UID, OTHER_UID)
    argv = [a.format(file=tmp_path / "file", foreign=tmp_path / "foreign") for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and says in captured.err, captured.err
