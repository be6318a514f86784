"""TargetSpec: the hardware facts the planners use, read once from the Target.

CUDA: the SM count and the SM limits come from the arch (TVM 0.27's cuda
target has no attribute for them); shared memory per block, threads per
block, the warp size, registers and the L2 size come from the target's
attributes where set (a tag such as "nvidia/nvidia-a100" sets them), else
from the arch. An arch missing from the table (a well-formed sm_NN[a-z])
takes the facts of the nearest older one listed (below sm_70: sm_70's),
with an UnknownArchWarning naming them; a malformed arch is a TargetError
listing the known ones. TVM fills in the arch of a cuda target that names
none (sm_50 where it finds no GPU), so name it:
`{"kind": "cuda", "arch": "sm_80"}`.
llvm: the cores are the runtime's thread count, read once when the spec is
made; the vector width and F16C (half-vector conversion) come from the
target's CPU (its mcpu and features, as LLVM reports them); the cache size
is the host's largest (sysfs), read once.

Every plan records the spec it was made for (`StitchPlan.spec`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import tvm
from tvm.target import Target

from tvm_stitch.errors import TargetError
from tvm_stitch.planning.time_fit import fitted_constants


@dataclass(frozen=True)
class _Arch:
    sms: int
    l2_bytes: int
    sm_threads: int
    sm_blocks: int
    sm_shared_bytes: int
    hbm_gbps: float  # peak device-memory bandwidth of the part, GB/s
    clock_ghz: float  # boost SM clock
    dram_latency_us: float  # a global load's latency under load (Little's law)
    math: "_Math"  # peak arithmetic rates of the part


@dataclass(frozen=True)
class _Math:
    """Peak dense rates of a part, TFLOP/s (INT8: TOPS), a multiply-add counted as two operations;
    0 where the part has no such unit."""

    fp32: float  # FP32 FMA (the CUDA cores)
    fp16: float  # FP16 FMA off the tensor cores (HFMA2)
    bf16: float  # BF16 FMA off the tensor cores
    tf32_tc: float  # tensor cores, dense: TF32, FP16 and BF16 with FP32 accumulation, INT8
    fp16_tc: float
    bf16_tc: float
    int8_tc: float


# Per CUDA arch, the part most built for: V100 (SXM2), T4, A100 (SXM4 80 GB), A40, RTX 4090,
# H200 (SXM; the H100 SXM has the same SMs and 3350 GB/s), B200.
# Bandwidth and clocks: NVIDIA's data sheets. DRAM latency: pointer-chase microbenchmarks report
# 400-600 ns idle on V100 to H100 (Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
# Microbenchmarking", 2018; Chips and Cheese's A100 and H100 articles, 2021 and 2023); loaded latency
# is higher: ~0.7 us is taken for the H200 (4.8 TB/s x 0.7 us: 3.4 MB in flight to saturate it),
# the others scaled alike. `tvm-stitch calibrate` fits them per arch from measured kernels.
# Math rates (docs/time-model.md names the sources): NVIDIA's V100, T4, A100, A40, Ada (RTX 4090, FP32
# accumulation) and H100 whitepapers and data sheets (the H200 has the H100 SXM's SMs and clocks); the
# B200's FP32 and FP16 FMA from its SMs and clock (128 FP32 lanes per SM, as on Hopper), its tensor
# rates from the DGX B200 data sheet (sparse figures halved). _Math's order: FP32, FP16, BF16 FMA; TF32, FP16,
# BF16, INT8 tensor cores.
_ARCHS = MappingProxyType({
    70: _Arch(sms=80, l2_bytes=6 << 20, sm_threads=2048, sm_blocks=32, sm_shared_bytes=96 << 10,
              hbm_gbps=900.0, clock_ghz=1.53, dram_latency_us=0.55,
              math=_Math(15.7, 31.4, 0.0, 0.0, 125.0, 0.0, 0.0)),
    75: _Arch(sms=40, l2_bytes=4 << 20, sm_threads=1024, sm_blocks=16, sm_shared_bytes=64 << 10,
              hbm_gbps=320.0, clock_ghz=1.59, dram_latency_us=0.6,
              math=_Math(8.1, 16.2, 0.0, 0.0, 65.0, 0.0, 130.0)),
    80: _Arch(sms=108, l2_bytes=40 << 20, sm_threads=2048, sm_blocks=32, sm_shared_bytes=164 << 10,
              hbm_gbps=2039.0, clock_ghz=1.41, dram_latency_us=0.65,
              math=_Math(19.5, 78.0, 39.0, 156.0, 312.0, 312.0, 624.0)),
    86: _Arch(sms=84, l2_bytes=6 << 20, sm_threads=1536, sm_blocks=16, sm_shared_bytes=100 << 10,
              hbm_gbps=696.0, clock_ghz=1.74, dram_latency_us=0.6,
              math=_Math(37.4, 37.4, 37.4, 74.8, 149.7, 149.7, 299.3)),
    89: _Arch(sms=128, l2_bytes=72 << 20, sm_threads=1536, sm_blocks=24, sm_shared_bytes=100 << 10,
              hbm_gbps=1008.0, clock_ghz=2.52, dram_latency_us=0.6,
              math=_Math(82.6, 82.6, 82.6, 82.6, 165.2, 165.2, 660.6)),
    90: _Arch(sms=132, l2_bytes=50 << 20, sm_threads=2048, sm_blocks=32, sm_shared_bytes=228 << 10,
              hbm_gbps=4800.0, clock_ghz=1.98, dram_latency_us=0.7,
              math=_Math(66.9, 133.8, 133.8, 494.7, 989.4, 989.4, 1978.9)),
    100: _Arch(sms=148, l2_bytes=126 << 20, sm_threads=2048, sm_blocks=32, sm_shared_bytes=228 << 10,
               hbm_gbps=8000.0, clock_ghz=1.96, dram_latency_us=0.75,
               math=_Math(74.3, 148.6, 148.6, 1100.0, 2250.0, 2250.0, 4500.0)),
})
MATH_UNITS = ("fp32", "fp16", "bf16", "tf32_tc", "fp16_tc", "bf16_tc", "int8_tc")
# The first arch whose atomicAdd takes each dtype (CUDA C++ Programming Guide, "atomicAdd()").
ATOMIC_ADD_SINCE = MappingProxyType({"float32": 20, "float16": 70, "bfloat16": 80})
# The first arch whose warp-level `mma.sync.aligned.m16n8k16` (float32 accumulator) takes each operand
# dtype (PTX ISA, "Warp-level matrix multiply-accumulate instructions": f16 and bf16 at m16n8k16 from sm_80).
MMA_M16N8K16_SINCE = MappingProxyType({"float16": 80, "bfloat16": 80})
# The first arch whose `mma.sync.aligned.m16n8k8` takes .tf32 multiplicands (float32 accumulator; same source).
MMA_TF32_SINCE = 80
# The share of the peak bandwidth the best memory-bound kernels reach (copies, norms and softmax over
# rows of 4K elements and more, as published and as `tvm-stitch bench --target cuda` measures).
CUDA_ACHIEVABLE_BANDWIDTH = 0.9
# The share of a math unit's peak the best arithmetic-bound kernels reach: optimized GEMMs reach up to
# 80-90% of the peak (Dao, "FlashAttention-2", 2023); cuBLAS-class FP16 GEMMs on the H100 about 75-80%.
CUDA_ACHIEVABLE_MATH = 0.8
# Back-to-back launches in one stream, host to device: a few microseconds each (NVIDIA's "Getting
# Started with CUDA Graphs", 2019: ~2-4 us per short kernel without graphs).
CUDA_LAUNCH_US = 3.0
# Special-function results (exp2, log2, rsqrt, rcp, sin, cos) per SM per clock: 16 on compute
# capability 7.x to 9.0 (CUDA C++ Programming Guide, arithmetic instruction throughput).
CUDA_SFU_PER_CLOCK = 16
DEFAULT_ARCH = "sm_90"
CUDA_SHARED_PER_BLOCK = 48 << 10  # static shared memory a block may declare without opting in
CUDA_REGISTERS_PER_SM = 64 << 10
CUDA_REGISTER_GRANULE = 256  # registers are allocated per warp in units of this
# The most 32-bit registers one thread may use: 255 on compute capability 5.0 and later (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability").
CUDA_MAX_REGISTERS_PER_THREAD = 255
CUDA_VECTOR_BYTES = 16  # the widest global load and store: 128 bits
# The share of the last-level cache a re-read buffer keeps while a kernel streams the rest through it
# (pricing/traffic.py, planning/attention_cost.py).
CUDA_RESIDENT_PER_MILLE = 80  # 4 MB of an H100's 50 MB L2
CPU_RESIDENT_PER_MILLE = 125  # 4 MB of a 32 MB L3
CPU_L1_BYTES = 32 << 10  # a core's level-1 data cache, where the OS does not report one
CPU_L2_BYTES = 512 << 10  # a core's level-2 cache, where the OS does not report one
CPU_CACHE_BYTES = 32 << 20  # a server CPU's last-level cache, where the OS does not report one


@dataclass(frozen=True)
class TargetSpec:
    """Hardware facts of one target, as plain data (it prints, compares and serialises)."""

    family: str  # "cuda" or "cpu"
    arch: str  # CUDA arch (sm_90) or the CPU model (mcpu; "" for generic)
    vector_bytes: int  # CUDA: widest global access; CPU: the SIMD register width
    cores: int = 1  # CPU: threads of the runtime's parallel loops
    converts_half: bool = False  # CPU: converts float16 vectors in hardware (x86 F16C)
    sms: int = 0  # CUDA: streaming multiprocessors
    shared_bytes_per_block: int = 0
    max_threads_per_block: int = 0
    warp_size: int = 0
    cache_bytes: int = 0  # the last-level cache: CUDA the L2, CPU the host's (read once)
    registers_per_sm: int = 0
    sm_threads: int = 0  # resident threads per SM at most
    sm_blocks: int = 0  # resident blocks per SM at most
    sm_shared_bytes: int = 0  # shared memory of an SM, over its resident blocks
    register_granule: int = 0
    max_registers_per_thread: int = 0  # CUDA: 32-bit registers one thread may use at most
    vector_registers: int = 0  # CPU: architectural vector registers (a matmul tile's accumulators live there)
    l1_bytes: int = 0  # CPU: a core's level-1 data cache (a chunk of a matmul's weight panel stays in it)
    l2_bytes: int = 0  # CPU: a core's level-2 cache (a matmul's whole weight, when it fits, is reused from it)
    atomic_add_dtypes: tuple = ()  # CUDA: dtypes `atomicAdd` adds to global memory in hardware
    mma_dtypes: tuple = ()  # CUDA: operand dtypes of the warp-level mma.sync m16n8k16 (float32 accumulator)
    mma_tf32: bool = False  # CUDA: the warp-level mma.sync m16n8k8 takes TF32 multiplicands
    # CUDA, for the time model (planning/time_model.py): achievable device-memory bandwidth (bytes/us),
    # loaded DRAM latency, launch overhead, special-function results per SM per us, the SM clock;
    # published figures, or the fitted table shipped for the arch (time_fit.py).
    hbm_bytes_per_us: float = 0.0
    dram_latency_us: float = 0.0
    launch_us: float = 0.0
    sfu_per_sm_us: float = 0.0
    clock_ghz: float = 0.0
    # CUDA: peak arithmetic per unit, operations per us over the whole GPU (a multiply-add is two;
    # 0: no such unit): FP32, FP16 and BF16 FMA; the tensor cores' dense TF32, FP16, BF16 and INT8.
    fp32_flops_per_us: float = 0.0
    fp16_flops_per_us: float = 0.0
    bf16_flops_per_us: float = 0.0
    tf32_tc_flops_per_us: float = 0.0
    fp16_tc_flops_per_us: float = 0.0
    bf16_tc_flops_per_us: float = 0.0
    int8_tc_flops_per_us: float = 0.0

    @staticmethod
    def from_target(target: Target) -> "TargetSpec":
        """The spec of a cuda or llvm Target; ValueError for another kind."""
        kind = target.kind.name
        if kind == "cuda":
            return _cuda_spec(target)
        if kind == "llvm":
            return _cpu_spec(target)
        raise ValueError(f"no TargetSpec for target kind {kind!r}: tvm-stitch plans for cuda and llvm")

    def describe(self) -> str:
        """One line: the facts that decide plans."""
        if self.family == "cuda":
            return (f"cuda {self.arch}: {self.sms} SMs, {self.shared_bytes_per_block // 1024} KB shared/block, "
                    f"{self.max_threads_per_block} threads/block, warp {self.warp_size}, "
                    f"{self.vector_bytes}-byte vectors, L2 {self.cache_bytes >> 20} MB")
        half = ", converts half vectors" if self.converts_half else ""
        cpu = self.arch or "generic (no mcpu: tvm_stitch.target.host_target() names this machine's CPU)"
        return (f"cpu {cpu}: {self.cores} cores, {self.vector_bytes * 8}-bit vectors{half}, "
                f"last-level cache {self.cache_bytes >> 20} MB")

    @staticmethod
    def from_dict(data: dict) -> "TargetSpec":
        return TargetSpec(**dict(data, atomic_add_dtypes=tuple(data.get("atomic_add_dtypes", ())),
                                 mma_dtypes=tuple(data.get("mma_dtypes", ()))))


class UnknownArchWarning(UserWarning):
    """A CUDA arch tvm-stitch has no facts for, planned with those of the nearest one it knows."""


def known_archs() -> tuple:
    """The CUDA archs whose facts tvm-stitch knows: ('sm_70', ..., 'sm_100')."""
    return tuple(f"sm_{n}" for n in _ARCHS)


def check_cuda_arch(arch: str) -> int:
    """The number of a CUDA arch `sm_NN[a-z]` (sm_90a: 90); TargetError listing the known archs
    for anything else."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if match is None:
        raise TargetError(f"unknown CUDA arch {arch!r}: expected sm_NN (an optional letter after it, as in "
                          f"sm_90a); archs tvm-stitch has facts for: {', '.join(known_archs())}")
    return int(match.group(1))


def _arch_facts(number: int) -> _Arch:
    """The facts of arch `number`, or of the nearest older one listed (the oldest's below them)."""
    return _ARCHS[_nearest_arch(number)]


def _nearest_arch(number: int) -> int:
    older = [n for n in _ARCHS if n <= number]
    return max(older) if older else min(_ARCHS)


def _warn_if_unknown(arch: str, number: int) -> None:
    """UnknownArchWarning naming the facts used for an arch missing from the table."""
    if number in _ARCHS:
        return
    used = _nearest_arch(number)
    facts = _ARCHS[used]
    warnings.warn(f"CUDA arch {arch} is not among those tvm-stitch has facts for ({', '.join(known_archs())}): "
                  f"planned with sm_{used}'s ({facts.sms} SMs, L2 {facts.l2_bytes >> 20} MB, "
                  f"{facts.hbm_gbps:.0f} GB/s)", UnknownArchWarning)


def _cuda_spec(target: Target) -> TargetSpec:
    attrs = target.attrs
    arch = str(attrs["arch"]) if "arch" in attrs else DEFAULT_ARCH
    number = check_cuda_arch(arch)
    _warn_if_unknown(arch, number)
    facts = _arch_facts(number)

    def attr(name: str, default: int) -> int:
        return int(attrs[name]) if name in attrs else default

    return TargetSpec(
        family="cuda",
        arch=arch,
        vector_bytes=CUDA_VECTOR_BYTES,
        sms=facts.sms,
        shared_bytes_per_block=attr("max_shared_memory_per_block", CUDA_SHARED_PER_BLOCK),
        max_threads_per_block=attr("max_threads_per_block", attr("max_num_threads", 1024)),
        warp_size=attr("thread_warp_size", 32),
        cache_bytes=attr("l2_cache_size_bytes", facts.l2_bytes),
        registers_per_sm=attr("registers_per_block", CUDA_REGISTERS_PER_SM),
        sm_threads=facts.sm_threads,
        sm_blocks=facts.sm_blocks,
        sm_shared_bytes=facts.sm_shared_bytes,
        register_granule=CUDA_REGISTER_GRANULE,
        max_registers_per_thread=CUDA_MAX_REGISTERS_PER_THREAD,
        atomic_add_dtypes=tuple(d for d, first in ATOMIC_ADD_SINCE.items() if number >= first),
        mma_dtypes=tuple(d for d, first in MMA_M16N8K16_SINCE.items() if number >= first),
        mma_tf32=number >= MMA_TF32_SINCE,
        **time_constants(arch, facts),
        **math_rates(facts),
    )


def math_rates(facts: _Arch) -> dict:
    """The arch's peak arithmetic per unit in operations per us (TargetSpec's `*_flops_per_us`)."""
    return {f"{unit}_flops_per_us": getattr(facts.math, unit) * 1e6 for unit in MATH_UNITS}


def time_constants(arch: str, facts: _Arch, fitted: dict | None = None) -> dict:
    """The time model's constants of a CUDA arch: those `fitted` (default: the table shipped for
    the arch, time_fit.py), else the published figures of `_ARCHS`."""
    published = {
        "hbm_bytes_per_us": facts.hbm_gbps * 1e3 * CUDA_ACHIEVABLE_BANDWIDTH,
        "dram_latency_us": facts.dram_latency_us,
        "launch_us": CUDA_LAUNCH_US,
        "sfu_per_sm_us": CUDA_SFU_PER_CLOCK * facts.clock_ghz * 1e3,
        "clock_ghz": facts.clock_ghz,
    }
    return dict(published, **(fitted_constants(arch) if fitted is None else fitted))


def _cpu_spec(target: Target) -> TargetSpec:
    return TargetSpec(
        family="cpu",
        arch=str(target.attrs.get("mcpu", "")),
        vector_bytes=_cpu_vector_bits(target) // 8,
        vector_registers=_cpu_vector_registers(target),
        cores=int(tvm.get_global_func("runtime.NumThreads")()),  # the runtime's threads, as threads.py sets them
        converts_half=_has_feature(target, "f16c"),
        cache_bytes=_host_cache_bytes(),
        l1_bytes=_host_cache_level(1, CPU_L1_BYTES),
        l2_bytes=_host_cache_level(2, CPU_L2_BYTES),
    )


def _cpu_vector_bits(target: Target) -> int:
    """The widest SIMD register of the target's CPU, from its features as LLVM knows them for
    the target's mcpu / mattr: x86 AVX-512F 512 bits, AVX 256, else 128 (SSE, Arm NEON).
    TVM 0.27's `llvm_get_vector_width` is not used: it answers 512 for every x86 CPU model
    on an AVX-512 host, generic x86-64 included."""
    return 512 if _has_feature(target, "avx512f") else 256 if _has_feature(target, "avx") else 128


def _cpu_vector_registers(target: Target) -> int:
    """AVX-512 and Arm's NEON have 32 vector registers, narrower x86 ISAs 16."""
    triple = str(target.attrs.get("mtriple", "") or "")
    arm = triple.startswith(("aarch64", "arm")) or _has_feature(target, "neon")
    return 32 if arm or _cpu_vector_bits(target) >= 512 else 16


def _host_cache_bytes() -> int:
    """This machine's largest CPU cache (Linux sysfs); CPU_CACHE_BYTES where the OS does not say."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)])
    return max(sizes, default=CPU_CACHE_BYTES)


def _host_cache_level(level: int, default: int) -> int:
    """This machine's data (or unified) cache of `level` per core (Linux sysfs); `default` where the
    OS does not say."""
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            found, kind, size = ((entry / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KM])", size)
        if found == str(level) and kind in ("Data", "Unified") and match:
            return int(match.group(1)) << {"K": 10, "M": 20}[match.group(2)]
    return default


def _has_feature(target: Target, feature: str) -> bool:
    """Whether an llvm target's CPU has an instruction-set feature (False where LLVM cannot say)."""
    try:
        return bool(tvm.target.codegen.target_has_features(feature, target))
    except Exception:  # noqa: BLE001 - a target LLVM has no feature table for
        return False
