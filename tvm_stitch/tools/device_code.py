"""Compiled CUDA device code on a machine without a GPU driver: how the GPU kit gets cubins.

Why this is needed (TVM 0.27): `target.build.cuda` emits CUDA *source* and
hands it to `CUDAModuleCreateWithFallback`. That factory looks up
`ffi.Module.create.cuda`, registered by TVM's CUDA runtime library
(`tvm/lib/libtvm_runtime_cuda.so`). Only that real module compiles the
source (through the `tvm_callback_cuda_compile` hook) and serializes the
compiled bytes. But `libtvm_runtime_cuda.so` links against the driver,
`libcuda.so.1`, and on a machine without one `import tvm` silently skips it:
the codegen then falls back to a placeholder module that stores the source,
and an exported library carries `__global__` text, never device code
(`TVM_CUDA_COMPILE_MODE=nvcc` changes nothing, the hook is never called).
Loading such a library on the GPU machine compiles it there, through a
Python hook that needs `Target.current()` from the compiler library that a
runtime-only `tvm` lacks.

What this module does instead:
- `write_standin_driver(folder)` writes a stand-in `libcuda.so.1` (built with
  the C compiler) defining every driver function `libtvm_runtime_cuda.so`
  imports, each failing with `CUDA_ERROR_NO_DEVICE`. With its folder on
  `LD_LIBRARY_PATH` of a *fresh* process, `import tvm` loads TVM's CUDA
  runtime; no driver function is called while compiling and exporting.
- `register_compiler(arch, resources)` registers (with `override=True`) a
  `tvm_callback_cuda_compile` that compiles with nvcc to PTX
  (`tvm.support.nvcc.compile_cuda`, TVM's own flags, inside a Target scope
  naming `arch`), then assembles it with `ptxas -v` to an `arch` cubin,
  recording each kernel's registers, static shared memory, stack and spills
  from ptxas's report (TVM's loaded module exposes no function attributes,
  so these are build-time figures). The real module stores the cubin, and an
  exported library carries it: on the GPU machine `cuModuleLoadData` loads it
  with no compiler and no Python hook.
- `device_code_kinds(path)` says what an exported library carries (cubin,
  fatbin, or CUDA source), for the tests and the kit's manifest.

Loading TVM's CUDA runtime changes what every later CUDA build of that
process does (each one calls nvcc), so the kit compiles in a child process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

FATBIN_MAGIC = bytes.fromhex("50ed55ba")
_ELF = b"\x7fELF"
_EM_CUDA = 190
_CUDA_ERROR_NO_DEVICE = 100
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")


def runtime_cuda_library() -> str:
    """Path of TVM's CUDA runtime library in the installed `tvm` package."""
    import tvm

    return os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")


def driver_imports(library: str) -> list:
    """The CUDA driver functions (`cu*`, unversioned) that `library` imports, read with `nm -D`."""
    if shutil.which("nm") is None:
        raise RuntimeError("`nm` (binutils) is needed to list the driver functions TVM's CUDA runtime imports")
    done = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith("cu") and "@" not in n)


def standin_driver_source(functions: list) -> str:
    """C source of a stand-in driver: every function fails with CUDA_ERROR_NO_DEVICE; the two
    error-name lookups answer with a message instead (TVM's error paths read it)."""
    lines = ["/* Stand-in libcuda.so.1 for building TVM CUDA modules without a GPU (tvm-stitch). */"]
    for name in functions:
        if name in ("cuGetErrorName", "cuGetErrorString"):
            lines.append(f"int {name}(int error, const char **text) "
                         "{ (void)error; *text = \"no CUDA driver (tvm-stitch build-time stand-in)\"; return 0; }")
        else:
            lines.append(f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}")
    return "\n".join(lines) + "\n"


def write_standin_driver(folder: str) -> str:
    """Build the stand-in `libcuda.so.1` into `folder` (put it on LD_LIBRARY_PATH); returns its path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("a C compiler (cc or gcc) is needed to build the stand-in libcuda.so.1")
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, "libcuda_standin.c")
    with open(source, "w", encoding="utf-8") as f:
        f.write(standin_driver_source(driver_imports(runtime_cuda_library())))
    path = os.path.join(folder, "libcuda.so.1")
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", path, source],
                   check=True, capture_output=True, text=True)
    return path


def cuda_runtime_loaded() -> bool:
    """Whether TVM's CUDA runtime is registered in this process (then CUDA builds compile)."""
    import tvm_ffi

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


def parse_ptxas(report: str) -> dict:
    """Per entry function of a `ptxas -v` report: registers, shared_bytes (static), stack_bytes,
    spill_store_bytes, spill_load_bytes, barriers."""
    kernels: dict = {}
    current = None
    for line in report.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = kernels.setdefault(entry.group(1), {})
            continue
        if current is None:
            continue
        stack = _STACK.search(line)
        if stack:
            current.update(stack_bytes=int(stack.group(1)), spill_store_bytes=int(stack.group(2)),
                           spill_load_bytes=int(stack.group(3)))
        used = _USED.search(line)
        if used:
            current["registers"] = int(used.group(1))
            smem, barriers = _SMEM.search(line), _BARRIERS.search(line)
            current["shared_bytes"] = int(smem.group(1)) if smem else 0
            current["barriers"] = int(barriers.group(1)) if barriers else 0
    return kernels


def compile_to_cubin(code: str, arch: str) -> tuple:
    """CUDA source -> (`arch` cubin bytes, per-kernel resources): nvcc to PTX with TVM's flags, then
    `ptxas -v` with the ptxas flags TVM uses."""
    import tvm
    from tvm.support import nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        ptx = nvcc.compile_cuda(code, target_format="ptx", arch=arch, compiler="nvcc")
    with tempfile.TemporaryDirectory(prefix="tvm-stitch-ptxas-") as tmp:
        ptx_path, cubin_path = os.path.join(tmp, "kernels.ptx"), os.path.join(tmp, "kernels.cubin")
        with open(ptx_path, "wb") as f:
            f.write(bytes(ptx))
        flags = [flag for flag in nvcc._ptxas_option_flags() if flag != "-v"]  # noqa: SLF001 - TVM's own flags
        done = subprocess.run(["ptxas", "-O3", "-v", f"-arch={arch}", *flags, "-o", cubin_path, ptx_path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed for {arch}:\n{done.stderr}")
        with open(cubin_path, "rb") as f:
            cubin = f.read()
    return cubin, parse_ptxas(done.stdout + done.stderr)


def register_compiler(arch: str, resources: dict) -> None:
    """Make every CUDA build of this process compile to an `arch` cubin; each kernel's resources
    (see `parse_ptxas`) are added to `resources` by kernel name."""
    import tvm_ffi

    def compile_cuda(code):
        cubin, kernels = compile_to_cubin(code, arch)
        resources.update(kernels)
        return bytearray(cubin)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def device_code_kinds(path: str) -> dict:
    """What an exported library carries: `cubins` (embedded CUDA ELF images), `fatbins` (fatbin
    headers) and `cuda_source` (whether `__global__` source text is present)."""
    with open(path, "rb") as f:
        data = f.read()
    cubins, start = 0, 1  # offset 0 is the library's own (host) ELF header
    while True:
        at = data.find(_ELF, start)
        if at < 0:
            break
        if int.from_bytes(data[at + 18: at + 20], "little") == _EM_CUDA:
            cubins += 1
        start = at + 1
    return {"cubins": cubins, "fatbins": data.count(FATBIN_MAGIC), "cuda_source": b"__global__" in data}
