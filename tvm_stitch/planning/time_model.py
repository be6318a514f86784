"""The CUDA time model: a kernel's launch geometry in, its modeled time and the parts of it out.

Plain data both ways (docs/time-model.md is the reference). A kernel runs
in waves: as many blocks at once as the SMs hold (occupancy from threads,
registers and shared memory per block, resources.occupancy), the last wave
possibly partial (the tail). Per wave the time is the largest of:
- bandwidth: the wave's device-memory bytes over the achievable bandwidth
  (the spec's, about 90% of the peak), or over what its SMs can move when
  few are busy (SM_BYTES_PER_CLOCK each);
- latency (Little's law): a thread keeps `loads in flight` global loads
  outstanding, so its loads take (loads / in flight) round trips of the
  DRAM latency, at least one per barrier-separated phase that loads, plus
  BARRIER_CYCLES per barrier; the bandwidth a wave reaches is then resident
  threads x bytes per load x loads in flight / latency;
- special functions: MUFU results (exp, log, rsqrt, erf and tanh as several)
  of the wave's threads on each SM at the spec's rate;
- serial depth: the serial loop iterations of a thread, SERIAL_CYCLES each;
- arithmetic: the wave's floating-point operations per unit (FP32, FP16 or
  BF16 FMA; a tensor core's TF32, FP16, BF16 or INT8 mma) on each SM at its
  share of the unit's achievable rate (the spec's peak `*_flops_per_us` over
  its SMs, times CUDA_ACHIEVABLE_MATH).
A contraction (a kernel of a matmul or a convolution left to TVM's rules,
`contraction`) waits on device memory only for the loads its caches do not
serve: its latency rounds are scaled by its DRAM bytes over the bytes its
threads load; the rest hides behind the arithmetic of the resident blocks.
The kernel's time is the launch overhead plus its waves' times. A packed
launch (independent kernels on consecutive ranges of blocks, a thread
running one member) is its members' waves one after the other, each
member's blocks at the occupancy of the whole launch (its registers and
shared memory are the largest member's), after one launch overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from tvm_stitch.planning.resources import occupancy
from tvm_stitch.planning.spec import CUDA_ACHIEVABLE_BANDWIDTH, CUDA_ACHIEVABLE_MATH, TargetSpec

SERIAL_UNROLL = 4  # iterations of a serial loop nvcc unrolls, whose independent loads overlap
MAX_LOADS_IN_FLIGHT = 8  # outstanding global loads per thread at most (scoreboard, registers)
BARRIER_CYCLES = 40  # a __syncthreads of a block whose warps arrive together
SERIAL_CYCLES = 8  # one serial iteration: a dependent add or max, the index update, the branch
SM_BYTES_PER_CLOCK = 64  # global loads an SM's load path returns per clock
DEFAULT_REGISTERS = 32  # per thread, where neither the plan nor ptxas says
# MUFU results per special function (CUDA's libdevice, accurate versions): one for exp, log, sqrt,
# rsqrt, sin, cos; tanh and erf take an exp and a reciprocal (or the equivalent polynomial), pow a
# log and an exp.
SFU_COST = MappingProxyType({"exp": 1, "exp2": 1, "exp10": 1, "log": 1, "log2": 1, "log10": 1, "log1p": 1, "sqrt": 1,
            "rsqrt": 1, "sin": 1, "cos": 1, "tan": 2, "tanh": 2, "erf": 2, "sigmoid": 2, "pow": 2})


@dataclass(frozen=True)
class KernelGeometry:
    """One kernel launch as scheduled: what the time model reads.

    `loads` / `stores`: (bytes per access, accesses per thread) of each global access site,
    the count multiplied by the loops around it. `load_sites`: global load instructions a
    thread may have in flight at once (unrolled copies count; a serial loop's body counts
    SERIAL_UNROLL times). `dram_bytes`: the bytes device memory moves (L2 reuse counted, as
    pricing/traffic.py models it); -1 for every access from device memory.
    """

    name: str
    grid: int  # blocks
    threads: int  # threads per block
    loads: tuple = ()
    stores: tuple = ()
    load_sites: int = 0
    load_phases: int = 0  # barrier-separated parts of a thread's work that load from global memory
    barriers: int = 0  # barriers a thread passes
    serial_iterations: int = 0  # iterations of serial loops a thread runs
    sfu_ops: float = 0.0  # special-function results per thread (SFU_COST weights)
    registers: int = DEFAULT_REGISTERS
    shared_bytes: int = 0  # static shared memory per block
    dram_bytes: int = -1
    members: tuple = ()  # a packed launch: each member's KernelGeometry on its range of blocks
    flops: tuple = ()  # (unit, operations per thread) per math unit of spec.MATH_UNITS; an FMA is two
    contraction: bool = False  # a kernel of a matmul or convolution left to TVM's rules (see above)

    @property
    def loaded_per_thread(self) -> int:
        return sum(width * count for width, count in self.loads)

    @property
    def stored_per_thread(self) -> int:
        return sum(width * count for width, count in self.stores)

    @property
    def accessed_bytes(self) -> int:
        """Bytes all threads load and store (before any cache)."""
        return (self.loaded_per_thread + self.stored_per_thread) * self.threads * self.grid

    @property
    def memory_bytes(self) -> int:
        return self.dram_bytes if self.dram_bytes >= 0 else self.accessed_bytes


@dataclass(frozen=True)
class KernelTime:
    """The modeled time of one launch and its parts (microseconds; parts summed over waves)."""

    name: str
    us: float
    launch_us: float
    bandwidth_us: float
    latency_us: float
    sfu_us: float
    serial_us: float
    waves: int  # full waves
    tail: float  # blocks of the last, partial wave over a full wave's (0: none)
    resident_threads: int  # threads of a full wave
    launched_threads: int  # grid x block
    occupancy: float
    bytes: int  # device-memory bytes
    bandwidth_fraction: float  # bytes / us over the arch's peak bandwidth
    bound: str  # the part that took most of the waves' time: bandwidth, latency, sfu, serial, compute or launch
    geometry: KernelGeometry | None = None  # what was priced
    compute_us: float = 0.0
    flops: float = 0.0  # operations of the launch, every unit's
    math_fraction: float = 0.0  # each unit's operations over its peak, summed, over us: the share of the math peak


def peak_bytes_per_us(spec: TargetSpec) -> float:
    """The arch's peak device-memory bandwidth (the achievable one over CUDA_ACHIEVABLE_BANDWIDTH)."""
    return spec.hbm_bytes_per_us / CUDA_ACHIEVABLE_BANDWIDTH


def resident_blocks(geometry: KernelGeometry, spec: TargetSpec) -> tuple:
    """(blocks resident on the GPU at once, occupancy of an SM)."""
    threads = max(1, min(geometry.threads, spec.sm_threads))
    share = occupancy(threads, max(1, geometry.registers), geometry.shared_bytes, spec)
    per_sm = max(1, int(round(share * spec.sm_threads)) // (-(-threads // spec.warp_size) * spec.warp_size))
    return per_sm * spec.sms, share


def math_rate(spec: TargetSpec, unit: str) -> float:
    """Peak operations per us of a math unit on the whole GPU; a unit the arch lacks runs as the
    FMA of its dtype (a tensor unit), or as FP32 FMA (converted in and out); infinite where the
    spec has no rates (a plan's JSON made before they existed: arithmetic is not priced)."""
    rate = getattr(spec, f"{unit}_flops_per_us")
    if rate > 0 or unit == "fp32":
        return rate if rate > 0 else float("inf")
    fallback = unit[:-3] if unit in ("fp16_tc", "bf16_tc") else "fp32"
    return math_rate(spec, fallback)


def thread_math_us(geometry: KernelGeometry, spec: TargetSpec) -> float:
    """Microseconds a thread's operations take on one SM at each unit's achievable rate (its peak's
    CUDA_ACHIEVABLE_MATH share) over the SMs."""
    return sum(ops * spec.sms / (math_rate(spec, unit) * CUDA_ACHIEVABLE_MATH) for unit, ops in geometry.flops)


def _loads_in_flight(geometry: KernelGeometry) -> float:
    loads = sum(count for _, count in geometry.loads)
    return max(1.0, min(loads, geometry.load_sites, MAX_LOADS_IN_FLIGHT))


def _wave(geometry: KernelGeometry, blocks: int, spec: TargetSpec) -> dict:
    """The parts of one wave of `blocks` blocks (microseconds)."""
    clock_per_us = spec.clock_ghz * 1e3
    busy_sms = min(spec.sms, blocks)
    bandwidth = min(spec.hbm_bytes_per_us, busy_sms * SM_BYTES_PER_CLOCK * clock_per_us)
    wave_bytes = geometry.memory_bytes * blocks / max(1, geometry.grid)
    loads = sum(count for _, count in geometry.loads)
    rounds = max(loads / _loads_in_flight(geometry), geometry.load_phases if loads else 0)
    if geometry.contraction:
        rounds = max(1.0 if loads else 0.0, rounds * min(1.0, geometry.memory_bytes / max(1, geometry.accessed_bytes)))
    latency = rounds * spec.dram_latency_us + geometry.barriers * BARRIER_CYCLES / clock_per_us
    blocks_per_sm = -(-blocks // spec.sms)
    sfu = blocks_per_sm * geometry.threads * geometry.sfu_ops / spec.sfu_per_sm_us
    serial = geometry.serial_iterations * SERIAL_CYCLES / clock_per_us
    compute = blocks_per_sm * geometry.threads * thread_math_us(geometry, spec)
    return {"bandwidth": wave_bytes / bandwidth, "latency": latency, "sfu": sfu, "serial": serial, "compute": compute}


def kernel_time(geometry: KernelGeometry, spec: TargetSpec) -> KernelTime:
    """The modeled time of one launch of `geometry` on `spec`'s GPU."""
    if spec.family != "cuda" or spec.hbm_bytes_per_us <= 0:
        raise ValueError(f"the time model needs a CUDA spec with its constants, not {spec.family} {spec.arch}")
    if geometry.grid < 1 or geometry.threads < 1:
        raise ValueError(f"{geometry.name}: grid {geometry.grid} x {geometry.threads} threads")
    per_wave, share = resident_blocks(geometry, spec)
    waves, tail_blocks = divmod(geometry.grid, per_wave)
    parts = {"bandwidth": 0.0, "latency": 0.0, "sfu": 0.0, "serial": 0.0, "compute": 0.0}
    total = 0.0
    for member in _members(geometry):
        member_waves, member_tail = divmod(member.grid, per_wave)
        for count, blocks in ((member_waves, per_wave), (1 if member_tail else 0, member_tail)):
            if not count:
                continue
            wave = _wave(member, blocks, spec)
            total += count * max(wave.values())
            for key, value in wave.items():
                parts[key] += count * value
    us = spec.launch_us + total
    biggest = max(parts, key=parts.get)
    bound = biggest if parts[biggest] > spec.launch_us else "launch"
    nbytes = geometry.memory_bytes
    flops, peak_us = _launch_flops(geometry, spec)
    return KernelTime(geometry.name, us, spec.launch_us, parts["bandwidth"], parts["latency"], parts["sfu"],
                      parts["serial"], waves, tail_blocks / per_wave, min(per_wave, geometry.grid) * geometry.threads,
                      geometry.grid * geometry.threads, share, nbytes, nbytes / us / peak_bytes_per_us(spec), bound,
                      geometry, parts["compute"], flops, peak_us / us)


def _launch_flops(geometry: KernelGeometry, spec: TargetSpec) -> tuple:
    """(operations of the launch, us they take at their units' peaks over the whole GPU)."""
    flops = peak_us = 0.0
    for member in _members(geometry):
        for unit, ops in member.flops:
            flops += ops * member.threads * member.grid
            peak_us += ops * member.threads * member.grid / math_rate(spec, unit)
    return flops, peak_us


def _members(geometry: KernelGeometry) -> tuple:
    """The parts of a launch priced one after the other: a packed launch's members, each with
    its share of the launch's device-memory bytes (by the bytes it accesses); else the launch."""
    if not geometry.members:
        return (geometry,)
    accessed = sum(m.accessed_bytes for m in geometry.members)
    share = geometry.dram_bytes >= 0 and accessed > 0
    return tuple(replace(m, dram_bytes=geometry.dram_bytes * m.accessed_bytes // accessed if share else -1)
                 for m in geometry.members)


def total_us(times) -> float:
    return sum(t.us for t in times)


def geometry_from_dict(data: dict) -> KernelGeometry:
    """A KernelGeometry from its `dataclasses.asdict` (as records store it)."""
    data = dict(data)
    for key in ("loads", "stores", "flops"):
        data[key] = tuple(tuple(pair) for pair in data.get(key, ()))
    data["members"] = tuple(geometry_from_dict(m) for m in data.get("members", ()))
    return KernelGeometry(**data)
