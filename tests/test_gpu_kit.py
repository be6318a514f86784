"""The GPU check kit: device code in every library, loading without a compiler, the dry run, and the
runner's failure isolation, budget and incremental writing (with stubbed contenders, no GPU)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tvm_stitch.tools import device_code
from tvm_stitch.tools.gpu_kit import L2_BYTES, LIMIT_BYTES, build_kit, folder_bytes, kit_work, resource_warnings
from tvm_stitch.tools.gpu_runner import run_kit

TOOLS = os.path.dirname(os.path.dirname(run_kit.__file__))

# Run in a fresh process with the pack's runtime-only tvm: load every CUDA library, with a compile hook that
# fails, so a library holding CUDA source (compiled at load time) cannot pass.
_LOAD_ALL = """
import ctypes, json, os, sys
os.environ["TVM_USE_RUNTIME_LIB"] = "1"
kit = sys.argv[1]
sys.path.insert(0, os.path.join(kit, "site"))
import tvm, tvm_ffi
assert not os.path.exists(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_compiler.so"))
def no_compiler(code):
    raise RuntimeError("a compiler was called while loading")
tvm_ffi.register_global_func("tvm_callback_cuda_compile", no_compiler, override=True)
ctypes.CDLL(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
manifest = json.load(open(os.path.join(kit, "manifest.json")))
kinds = {}
for entry in manifest["entries"]:
    for build in ("default", "stitched"):
        stack = [tvm.runtime.load_module(os.path.join(kit, entry[build]))]
        while stack:
            module = stack.pop()
            kinds[module.kind] = kinds.get(module.kind, 0) + 1
            stack.extend(module.imports)
print(json.dumps(kinds))
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpukit") / "kit")
    # The ffi wheel download needs the package index; the pack is checked without it here.
    manifest = build_kit(out, size="test", graphs=["layernorm_softmax", "adam_update"], wheel=False)
    return out, manifest


def test_every_library_carries_sm90a_device_code(kit):
    out, manifest = kit
    assert [(e["name"], e["dtype"]) for e in manifest["entries"]] == [
        ("layernorm_softmax", "float32"), ("layernorm_softmax", "float16"), ("adam_update", "float32")]
    for entry in manifest["entries"]:
        assert entry["launches_stitched"] < entry["launches_default"]
        for build in ("default", "stitched"):
            kinds = device_code.device_code_kinds(os.path.join(out, entry[build]))
            assert kinds["cubins"] >= 1 and not kinds["cuda_source"], (entry[build], kinds)
            assert entry[f"kernels_{build}"], entry[build]
            assert all(k["registers"] > 0 for k in entry[f"kernels_{build}"].values())
            # The time model's figure per PrimFunc, with the geometry that calibration refits.
            modeled = entry[f"modeled_{build}"]
            assert modeled and all(m["modeled_us"] > 0 and m["kernels"] for m in modeled.values())
            assert sum(m["calls"] * len(m["kernels"]) for m in modeled.values()) == entry[f"launches_{build}"]
    assert manifest["entries"][2]["schemes_stitched"] == ["row-resident", "independent"]
    assert 0 < manifest["expected_seconds"]["quick"] < manifest["expected_seconds"]["full"]
    assert manifest["warnings"] == []  # no kernel over 48 KiB of static shared memory or spilling here
    assert folder_bytes(out) < LIMIT_BYTES - (8 << 20)  # room for the ~3 MB ffi wheel


def test_resource_warnings_name_big_static_shared_memory_and_spills():
    entries = [{"name": "g", "dtype": "float16", "kernels_default": {"k": {"shared_bytes": 100}},
                "kernels_stitched": {"s": {"shared_bytes": 74304, "spill_store_bytes": 8}}}]
    assert resource_warnings(entries) == ["g float16 stitched s: 74304 B static shared memory (> 48 KiB)",
                                          "g float16 stitched s: 8 B register spill stores"]


def test_kit_work_adds_the_hbm_set_at_the_bench_size():
    work = kit_work("bench", graphs=["softmax", "adam_update", "rmsnorm"], dtypes=("float32",))
    assert [(w["name"], w["dims"]["rows"], w["dims"]["cols"]) for w in work] == [
        ("softmax", 4096, 768), ("adam_update", 4096, 768), ("rmsnorm", 4096, 768),
        ("rmsnorm_hbm", 65536, 1024), ("softmax_hbm", 65536, 1024), ("adam_update_hbm", 4096, 2360)]
    assert 65536 * 1024 * 4 >= 4 * L2_BYTES and 18 * 2360 ** 2 >= 100e6  # several times the L2; 100M parameters
    with pytest.raises(ValueError, match="unknown suite graphs: nope"):
        kit_work("bench", graphs=["nope"])


def test_kit_work_adds_a_bfloat16_and_a_float16_gemm():
    work = [w for w in kit_work("bench") if w["graph"] == "gemm"]
    assert [(w["name"], w["dtype"], w["dims"]) for w in work] == [
        ("gemm", dt, {"rows": 4096, "cols": 4096, "depth": 4096}) for dt in ("bfloat16", "float16")]


def test_runner_makes_the_gemm_inputs_and_reference(monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)
    (entry,) = [w for w in kit_work("test", graphs=["gemm"]) if w["dtype"] == "bfloat16"]
    (a, b), (ref,) = run_kit._data(entry)
    assert str(a.dtype) == "bfloat16" and a.shape == (128, 64) and b.shape == (64, 96)
    np.testing.assert_allclose(ref, a.astype(np.float64) @ b.astype(np.float64))


@pytest.mark.slow
def test_the_kit_builds_the_gemms_with_tensor_cores_in_the_stitched_build(tmp_path):
    """Both GEMMs build, compile to cubins and export; the stitched kernels run on mma.sync (ptxas
    sees no spill: the manifest has no warning)."""
    out = str(tmp_path / "kit")
    manifest = build_kit(out, size="test", graphs=["gemm"], wheel=False)
    assert [(e["name"], e["dtype"]) for e in manifest["entries"]] == [("gemm", "bfloat16"), ("gemm", "float16")]
    for entry in manifest["entries"]:
        for build in ("default", "stitched"):
            kinds = device_code.device_code_kinds(os.path.join(out, entry[build]))
            assert kinds["cubins"] >= 1 and not kinds["cuda_source"], (entry[build], kinds)
        assert entry["launches_stitched"] == entry["launches_default"] == 1
    assert manifest["warnings"] == []


def test_libraries_load_with_the_runtime_only_tvm_and_no_compiler(kit, tmp_path):
    out, manifest = kit
    driver = str(tmp_path / "driver")
    device_code.write_standin_driver(driver)  # the GPU machine has the real one
    env = dict(os.environ, LD_LIBRARY_PATH=driver, PYTHONPATH="")
    done = subprocess.run([sys.executable, "-c", _LOAD_ALL, out], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = json.loads(done.stdout.strip().splitlines()[-1])
    assert kinds["cuda"] == 2 * len(manifest["entries"])


def test_dry_run_passes(kit, tmp_path):
    out, _ = kit
    results = str(tmp_path / "results")
    done = subprocess.run([sys.executable, os.path.join(out, "run_kit.py"), "--dry-run", "--out", results],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(results, "results.json"), encoding="utf-8") as f:
        header = json.load(f)["header"]
    assert header["cpu_build_correct"] and not header["missing_libraries"]


def test_ptxas_report_parsing():
    report = """ptxas info    : Compiling entry function 'k0' for 'sm_90a'
ptxas info    : Function properties for k0
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1092 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, 360 bytes cmem[0]
"""
    assert device_code.parse_ptxas(report) == {
        "k0": {"registers": 40, "shared_bytes": 1092, "barriers": 1, "stack_bytes": 8, "spill_store_bytes": 4,
               "spill_load_bytes": 4},
        "k1": {"registers": 12, "shared_bytes": 0, "barriers": 0, "stack_bytes": 0, "spill_store_bytes": 0,
               "spill_load_bytes": 0}}


# --- the runner's loop, with stubbed contenders ----------------------------------------------

class _Contender:
    def __init__(self, value):
        self.value = value

    def run(self):
        return self.value

    def outputs(self):
        return [np.full(3, self.value)]


class _Timer:
    """Stands in for CudaTimer: every call takes 2 ms; a contender's run() raising is a timing failure."""

    def calls_for(self, run):
        run()
        return 3

    def measure(self, run, calls):
        for _ in range(calls):
            run()
        return 2.0 * calls, calls


def _entries(*names):
    return [{"name": n, "graph": n, "dtype": "float32", "dims": {}, "seed": 0, "ideal_bytes": 4_000_000}
            for n in names]


def _load_data(entry):
    if entry["name"] == "bad_data":
        raise ValueError("inputs cannot be made")
    return [], [np.full(3, 1.0)]


def test_runner_isolates_failures_and_writes_after_every_graph(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)  # tolerance.py and workloads/, shipped beside run_kit.py in the pack
    out = str(tmp_path)
    seen_on_disk = []

    def stitched(entry, inputs):
        with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
            seen_on_disk.append([r["key"] for r in json.load(f)["rows"] if r["passes"]])
        if entry["name"] == "stitched_raises":
            raise RuntimeError("CUDALaunch Error: launch failed")
        return _Contender(1.0)

    contenders = {"default": lambda e, i: _Contender(1.0), "stitched": stitched}
    state = run_kit._new_state("quick")
    done = run_kit.run_passes(state, _entries("ok", "stitched_raises", "bad_data", "last"), [("tvm", contenders)],
                              out, 600, _load_data, _Timer(), rounds=2)
    assert done
    rows = {r["name"]: r for r in json.load(open(os.path.join(out, "results.json"), encoding="utf-8"))["rows"]}
    assert rows["ok"]["stitched_correct"] and rows["ok"]["stitched_ms"] == 2.0 and rows["ok"]["speedup"] == 1.0
    assert "launch failed" in rows["stitched_raises"]["stitched_error"] and rows["stitched_raises"]["default_correct"]
    assert "inputs cannot be made" in rows["bad_data"]["tvm_error"]
    assert rows["last"]["stitched_correct"]
    # Before each graph's stitched contender ran, every earlier graph was already on disk.
    assert seen_on_disk == [[], ["ok/float32"], ["ok/float32", "stitched_raises/float32", "bad_data/float32"]]
    assert "| last | float32 |" in open(os.path.join(out, "results.md"), encoding="utf-8").read()


def test_runner_records_wrong_results_and_timing_failures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)

    class FailsWhenTimed(_Contender):
        def run(self):
            raise RuntimeError("illegal memory access")

    contenders = {"default": lambda e, i: _Contender(5.0), "stitched": lambda e, i: FailsWhenTimed(1.0)}
    state = run_kit._new_state("quick")
    run_kit.run_passes(state, _entries("g"), [("tvm", contenders)], str(tmp_path), 600, _load_data, _Timer(), 2)
    row = state["rows"]["g/float32"]
    assert row["default_correct"] is False and row["default_max_error"] == 4.0 and row["default_ms"] == 2.0
    assert "illegal memory access" in row["stitched_error"] and "stitched_ms" not in row


def test_runner_budget_restart_and_resume(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)
    out = str(tmp_path)
    made, now = [], [0.0]

    def make(entry, inputs):
        made.append(entry["name"])
        if entry["name"] == "c":
            now[0] = 1e9  # the budget is spent while graph c runs
        if entry["name"] == "b":
            raise RuntimeError("unspecified launch failure")
        return _Contender(1.0)

    passes = [("tvm", {"stitched": make})]
    state = run_kit._new_state("quick")
    # A failure that leaves the device unusable stops the run after writing, for a restart.
    assert not run_kit.run_passes(state, _entries("a", "b", "c"), passes, out, 600, _load_data, None, 2,
                                  alive=lambda: False)
    assert state["header"]["restart_after"] == "b/float32" and made == ["a", "b"]
    resumed = run_kit._load_state(out, "results", "quick", resume=True)
    assert resumed["header"]["restarts"] == 1
    # The resumed run starts no graph done before, and none once the budget is spent.
    resumed["header"]["started"] = 0.0
    assert run_kit.run_passes(resumed, _entries("a", "b", "c", "d"), passes, out, 600, _load_data, None, 2,
                              clock=lambda: now[0])
    assert made == ["a", "b", "c"]
    assert resumed["header"]["skipped_for_budget"] == ["tvm: d/float32"]


def _square(entry):
    if entry["name"] == "bad":
        raise ValueError("bad entry")
    return entry["seed"] ** 2


def test_prefetch_serves_every_use_and_reports_errors():
    entries = [{"name": n, "dtype": "float32", "seed": i, "ideal_bytes": i} for i, n in enumerate("ab") ]
    bad = {"name": "bad", "dtype": "float32", "seed": 9}
    prefetch = run_kit.Prefetch(_square, entries + [bad] + entries[:1], workers=2)
    try:
        assert prefetch(entries[1]) == 1  # in any order
        with pytest.raises(ValueError, match="bad entry"):
            prefetch(bad)  # the worker's error reaches the caller
        assert prefetch(entries[0]) == 0 and prefetch(entries[0]) == 0  # two uses, one making
        assert "a/float32" not in prefetch.futures
        assert prefetch({"name": "c", "dtype": "float32", "seed": 3}) == 9  # not in the order: made here
    finally:
        prefetch.close()


def test_torch_graphs_match_the_numpy_references():
    torch = pytest.importorskip("torch")
    from tvm_stitch.tools.workloads import SUITE, dims, reference

    for name, graph in SUITE.items():
        inputs = graph.inputs(np.random.default_rng(0), "float32", dims("test"))
        refs = reference(graph, inputs)
        out = graph.torch(*[torch.from_numpy(a) for a in inputs])
        out = out if isinstance(out, tuple) else (out,)
        assert len(out) == len(refs), name
        for got, want in zip(out, refs):
            np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-4, err_msg=name)


# The runner's machine has TVM's runtime only: the pack's workloads must make inputs and references
# without importing tvm (nor the Relax builders, which are left out of the pack).
_WORKLOADS_WITHOUT_TVM = """
import sys
sys.path.insert(0, sys.argv[1])
sys.modules["tvm"] = None  # any import of tvm raises ImportError
import numpy as np
import workloads
for name, graph in workloads.SUITE.items():
    inputs = graph.inputs(np.random.default_rng(0), "float32", workloads.dims("test"))
    assert workloads.reference(graph, inputs), name
print(len(workloads.SUITE))
"""


def test_pack_workloads_need_no_tvm(kit):
    out, _ = kit
    assert not os.path.exists(os.path.join(out, "workloads", "relax_blocks.py"))
    done = subprocess.run([sys.executable, "-c", _WORKLOADS_WITHOUT_TVM, out], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=""), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == 17


def test_a_crash_is_recorded_beside_the_results(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)
    state = run_kit._new_state("quick")
    state["rows"]["g/float32"] = {"key": "g/float32", "name": "g", "dtype": "float32", "passes": ["tvm"]}
    run_kit.write_results(str(tmp_path), state)
    try:
        raise OSError("libcudart.so.13 not found")
    except OSError as err:
        run_kit.record_crash(str(tmp_path), "results", err)
    saved = json.load(open(tmp_path / "results.json", encoding="utf-8"))
    assert saved["rows"][0]["name"] == "g" and "libcudart.so.13" in saved["header"]["crash"]
    run_kit.record_crash(str(tmp_path / "none"), "sanitize", ValueError("no manifest entry"))  # no results yet
    with open(tmp_path / "none" / "sanitize.json", encoding="utf-8") as f:
        assert "no manifest entry" in json.load(f)["header"]["crash"]


def test_agreement_uses_the_tolerance_table_and_never_passes_nan(monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)
    ref = [np.array([1.0, 2.0, 3.0])]
    assert run_kit._agree([np.array([1.0, 2.0002, 3.0], np.float32)], ref, "float32")[0]
    assert not run_kit._agree([np.array([1.0, 2.01, 3.0], np.float32)], ref, "float32")[0]
    assert run_kit._agree([np.array([1.0, 2.01, 3.0], np.float16)], ref, "float16")[0]
    ok, err = run_kit._agree([np.array([1.0, np.nan, 3.0])], ref, "float32")
    assert not ok and np.isnan(err)
    assert run_kit._agree([np.ones(2)], ref, "float32") == (False, float("inf"))  # wrong shape
    assert run_kit._agree([], ref, "float32") == (False, float("inf"))  # an output missing


def test_call_times_mark_every_primfunc_call_of_a_real_vm(tmp_path):
    import time

    import tvm
    from tvm import relax

    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.workloads import SUITE, dims

    built = build(SUITE["layernorm_softmax"].build("float32", dims("test")), {"kind": "llvm"}, stitched=False)
    names = [gv.name_hint for gv, f in built.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    times = run_kit.CallTimes(vm, names, time.perf_counter, lambda a, b: (b - a) * 1e3)
    inputs = SUITE["layernorm_softmax"].inputs(np.random.default_rng(0), "float32", dims("test"))
    vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    per_call = times.per_call_us()
    assert set(per_call) and set(per_call) <= set(names)
    assert all(us > 0 for us in per_call.values())
    assert times.per_call_us() == {}  # read once


def test_calibration_records_come_from_the_measured_primfuncs():
    rows = [{"key": "softmax/float32", "stitched_primfunc_times": {
        "stitch_0": {"measured_us": 9.0, "modeled_us": 8.8, "kernels": [{"name": "k", "grid": 1, "threads": 32}]}}}]
    (record,) = run_kit.calibration_records({"plan_arch": "sm_90", "gpu": "NVIDIA H200"}, rows)
    assert record["arch"] == "sm_90" and record["device"] == "NVIDIA H200" and record["build"] == "stitched"
    assert record["measured_us"] == 9.0 and record["kernels"][0]["grid"] == 1


def test_kit_work_ends_with_the_half_precision_model_step():
    work = kit_work("bench")
    assert work[-1] == {"name": "llama_forward", "graph": "model:llama", "model": "llama", "step": "forward",
                        "dtype": "float16", "model_size": "cpu", "dims": {}, "seed": 0, "rel_error": 3e-2}
    assert sum("model" in w for w in work) == 1
    assert not any("model" in w for w in kit_work("test", dtypes=("float32",)))
    assert [w["name"] for w in kit_work("test", graphs=["llama_forward"])] == ["llama_forward"]


def test_a_model_step_is_checked_from_its_data_file_by_relative_error(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)
    monkeypatch.setattr(run_kit, "HERE", str(tmp_path))
    expected = [np.array([[100.0, -50.0], [1.0, 2.0]], np.float32), np.array([1e-9, 0.0], np.float32)]
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "m.npz", input_0=np.arange(4, dtype=np.int64), input_1=np.ones(3, np.float16),
             expected_0=expected[0], expected_1=expected[1])
    entry = {"name": "m", "dtype": "float16", "data": os.path.join("data", "m.npz"), "rel_error": 3e-2,
             "model": "m"}
    inputs, refs = run_kit._data(entry)
    assert [a.dtype for a in inputs] == [np.int64, np.float16] and inputs[0].tolist() == [0, 1, 2, 3]
    assert all(r.dtype == np.float64 for r in refs)
    # 2.0 off on an output of magnitude 100: 2e-2 relative passes, though the element-wise table would fail it
    close = [np.array([[100.0, -50.0], [1.0, 4.0]], np.float16), np.array([0.0, 0.0], np.float16)]
    assert run_kit._check(entry, close, refs) == (True, 0.02)
    assert not run_kit._agree(close, refs, "float16")[0]
    far = [np.array([[104.0, -50.0], [1.0, 2.0]], np.float16), close[1]]
    assert run_kit._check(entry, far, refs)[0] is False
    nan = [np.array([[np.nan, -50.0], [1.0, 2.0]], np.float16), close[1]]
    ok, err = run_kit._check(entry, nan, refs)
    assert not ok and np.isnan(err)
    assert run_kit._check(entry, close[:1], refs) == (False, float("inf"))


@pytest.mark.slow
def test_the_model_step_builds_into_a_kit_whose_dry_run_passes(tmp_path):
    """The half-precision model step through the kit: imported, built both ways to sm_90a cubins, its data
    file written; the runner's dry run loads every library and the data file."""
    out = str(tmp_path / "kit")
    manifest = build_kit(out, size="test", graphs=["llama_forward"], wheel=False)
    (entry,) = manifest["entries"]
    assert entry["dtype"] == "float16" and entry["launches_stitched"] < entry["launches_default"]
    assert os.path.exists(os.path.join(out, entry["data"]))
    done = subprocess.run([sys.executable, os.path.join(out, "run_kit.py"), "--dry-run", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
