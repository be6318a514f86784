"""pocl is probed before use: a pocl whose compiler rejects this processor is passed over, and when
none runs kernels the error names the cause (tvm_stitch/simt/pocl_probe.py)."""

import pytest

pytest.importorskip("pyopencl")

from tvm_stitch.simt import opencl_run, pocl_probe  # noqa: E402
from conftest import opencl_device  # noqa: E402

WHEEL_POCL = "OpenCL 3.0 PoCL 3.0-rc2  Linux, Release, RELOC, LLVM 14.0.6"
LOG = """Build on <pyopencl.Device 'pthread-AMD EPYC'>:

error: unknown target CPU 'generic'
Device pthread-AMD EPYC failed to build the program"""


def test_device_for_gives_a_pocl_that_runs_kernels():
    device = opencl_device(False)
    assert device.platform.name.startswith(opencl_run.POCL)
    assert pocl_probe.build_problem(device) == ""


def test_the_build_log_gives_its_error_line():
    assert pocl_probe._error_line(LOG) == "error: unknown target CPU 'generic'"
    assert pocl_probe._error_line("clBuildProgram failed") == "clBuildProgram failed"


def test_unknown_cpu_is_named_with_the_remedy():
    message = pocl_probe.unusable_message([(WHEEL_POCL, pocl_probe._error_line(LOG))])
    assert "LLVM 14.0.6: error: unknown target CPU 'generic'" in message
    assert "does not know this processor" in message
    assert "apt-get install pocl-opencl-icd" in message


def test_other_failures_are_not_blamed_on_the_processor():
    message = pocl_probe.unusable_message([(WHEEL_POCL, "clBuildProgram failed: OUT_OF_HOST_MEMORY")])
    assert "OUT_OF_HOST_MEMORY" in message and "does not know this processor" not in message
