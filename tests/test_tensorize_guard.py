"""The tensorize guard: which tvm-ffi releases fault in TVM's Tensorize, and the guard's effect."""

import os
import re
import subprocess
import sys

import pytest
import tvm
from tvm import relax

from schedules.tensorize_guard import (FIRST_FAULTING_FFI, NO_TENSORIZE, NoTensorize, ffi_release,
                                        tensorize_faults)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_JSON = "import tvm; from tvm import tirx; print(len(tvm.ir.save_json(tirx.IntImm('int32', 1))))"


def test_ffi_release_and_the_faulting_range():
    assert ffi_release("0.1.15.post2") == (0, 1, 15)
    assert ffi_release("0.1.14") == (0, 1, 14)
    assert not tensorize_faults("0.1.14.post1") and not tensorize_faults("0.1.14.post0")
    assert tensorize_faults("0.1.15.post1") and tensorize_faults("0.1.15.post2")
    with pytest.raises(ValueError, match="not a release version"):
        ffi_release("latest")


def test_the_predicate_matches_the_installed_tvm_ffi():
    """save_json of an IntImm (the ToJSONGraph that Tensorize's DeepCopy runs) dies in a child process
    exactly where tensorize_faults() says so."""
    done = subprocess.run([sys.executable, "-c", SAVE_JSON], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TVM_NUM_THREADS="1"))
    assert (done.returncode != 0) == tensorize_faults(), (done.returncode, done.stderr[-1000:])


def test_the_project_pins_the_last_release_that_serialises():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pin = re.search(r'"apache-tvm-ffi[^"]*<([0-9.]+)"', f.read())
    assert pin is not None and ffi_release(pin.group(1)) == FIRST_FAULTING_FFI


def _gemm_module() -> tvm.IRModule:
    a = relax.Var("a", relax.TensorType((256, 128), "float16"))
    b = relax.Var("b", relax.TensorType((128, 256), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(a, b)))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def test_no_tensorize_opts_out_only_where_tensorize_faults():
    mod = NoTensorize()(_gemm_module())
    prims = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims
    for func in prims:
        assert (func.attrs is not None and NO_TENSORIZE in func.attrs) == tensorize_faults()
