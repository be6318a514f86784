"""The GEMM kernels of a CUDA build as nvcc compiles them: mma instructions in their PTX, registers and spills.

A build's CUDA source is compiled once with nvcc to PTX for an arch, the PTX
assembled with `ptxas -v` (what `nvcc -cubin -Xptxas -v` runs); per GEMM
kernel (a PrimFunc the tensor-core rule or a dlight rule scheduled that
contracts two tensors, classify.is_compute_kernel, or a fused attention
kernel, rewrites/attention.py, rule "attention") the count of tensor-core
multiply instructions in its PTX entry (`mma.sync` or `wmma.mma`), its
registers and its spill bytes. Needs nvcc and ptxas on the PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from tvm_stitch.analysis.classify import is_compute_kernel
from tvm_stitch.pricing.gemm_choice import RULE_ATTR
from tvm_stitch.tools.device_code import parse_ptxas
from tvm_stitch.tools.launches import cuda_source, primfunc_calls

ATTENTION_ATTR = "tvm_stitch.attention"
MMA = re.compile(r"\b(?:mma\.sync|wmma\.mma\.sync)\.")


@dataclass(frozen=True)
class GemmKernel:
    """One CUDA kernel of a GEMM PrimFunc, as ptxas assembled it for one arch."""

    primfunc: str
    rule: str  # the schedule rule (tensor_core_matmul, a dlight rule's class name, or "attention")
    kernel: str  # the PTX entry
    mma: int  # tensor-core multiply instructions in its PTX
    registers: int
    spill_bytes: int  # spill stores plus spill loads


def compile_ptx(source: str, arch: str, folder: str) -> tuple:
    """(PTX text, ptxas -v resources per entry, see device_code.parse_ptxas) of CUDA `source`."""
    nvcc, ptxas = shutil.which("nvcc"), shutil.which("ptxas")
    if nvcc is None or ptxas is None:
        raise RuntimeError("gemm_ptx needs nvcc and ptxas on the PATH")
    cu, ptx, cubin = (os.path.join(folder, f"kernels.{ext}") for ext in ("cu", "ptx", "cubin"))
    with open(cu, "w", encoding="utf-8") as f:
        f.write(source)
    for command in ([nvcc, "--ptx", f"-arch={arch}", "-w", "-o", ptx, cu],
                    [ptxas, "-v", f"-arch={arch}", "-o", cubin, ptx]):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(command[0])} failed for {arch}:\n{done.stderr[-2000:]}")
    with open(ptx, encoding="utf-8") as f:
        return f.read(), parse_ptxas(done.stdout + done.stderr)


def ptx_entries(ptx: str) -> dict:
    """PTX text per `.entry` name."""
    return {part.split("(")[0].strip(): part for part in re.split(r"\.entry\s+", ptx)[1:]}


def _rule(func) -> str | None:
    attrs = func.attrs if func.attrs is not None else {}
    if RULE_ATTR in attrs:
        return str(attrs[RULE_ATTR])
    return "attention" if ATTENTION_ATTR in attrs else None


def gemm_primfuncs(lowered) -> dict:
    """Schedule rule per called GEMM PrimFunc of a lowered CUDA module, the fused attention kernels
    included ("attention"), the other stitched kernels not."""
    rules = {}
    for name in primfunc_calls(lowered):
        func = lowered[name]
        rule = _rule(func)
        if rule is not None and is_compute_kernel(func):
            rules[name] = rule
    return rules


def gemm_kernels(built, arch: str) -> list:
    """GemmKernel per CUDA kernel of each GEMM PrimFunc of `built` (a tools.build.Built for CUDA)."""
    with tempfile.TemporaryDirectory(prefix="tvm-stitch-gemm-ptx-") as folder:
        ptx, resources = compile_ptx(cuda_source(built.executable), arch, folder)
    entries = ptx_entries(ptx)
    found = []
    for name, rule in sorted(gemm_primfuncs(built.lowered).items()):
        pattern = re.compile(rf"^{re.escape(name)}_kernel(_\d+)?$")
        for entry in sorted(e for e in entries if pattern.match(e)):
            used = resources.get(entry, {})
            found.append(GemmKernel(name, rule, entry, len(MMA.findall(entries[entry])), used.get("registers", 0),
                                    used.get("spill_store_bytes", 0) + used.get("spill_load_bytes", 0)))
    return found
