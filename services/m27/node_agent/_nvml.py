"""NVML, kept thin: a few calls through a `lib` object (the pynvml module in production, a
fake in tests) and pure conversions of their raw values into `GpuInfo` / `GpuSample`.

NVML reports memory in bytes, power in milliwatts and energy in millijoules; m27 records use
MB, W and J. Many boards (and MIG-enabled GPUs) answer some queries with NotSupported: such a
reading becomes None (or is listed in `NvmlReading.missing`), it never fails the sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import pynvml

from m27.common.model import GpuInfo, GpuProcess, GpuSample
from m27.common.platform import Platform, cuda_from_nvml

MIB: Final = 1024 * 1024

#: The pynvml module, or anything with the same functions (tests pass a fake).
NvmlLib = Any
NvmlHandle = Any
T = TypeVar("T")

#: What an NVML query may raise: an NVML status (NotSupported, GpuIsLost, ...), or — from
#: pynvml's unversioned wrappers — a library/driver version mismatch.
NVML_ERRORS: Final[tuple[type[Exception], ...]] = (
    pynvml.NVMLError, getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError))

# Clocks event ("throttle") reasons, as NVML and DCGM number them.
SW_POWER_CAP: Final = 0x04
HW_SLOWDOWN: Final = 0x08
SW_THERMAL_SLOWDOWN: Final = 0x20
HW_THERMAL_SLOWDOWN: Final = 0x40
HW_POWER_BRAKE_SLOWDOWN: Final = 0x80
THERMAL_BITS: Final = SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN
POWER_BITS: Final = SW_POWER_CAP | HW_POWER_BRAKE_SLOWDOWN


def text(value: str | bytes) -> str:
    """NVML strings are bytes in older pynvml releases and str in newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def gpu_info_from_raw(index: int, name: str | bytes, uuid: str | bytes,
                      memory_total_bytes: int) -> GpuInfo:
    return GpuInfo(index=index, name=text(name), uuid=text(uuid),
                   memory_total_mb=int(memory_total_bytes) // MIB, simulated=False)


def throttle_from_mask(mask: int | None) -> tuple[str, ...]:
    """NVML's clocks-event bitmask as m27's reasons: thermal (HW/SW thermal slowdown) and
    power (SW power cap, HW power brake). Other bits (idle, app clocks, sync boost) are not
    throttling in the sense users care about."""
    if not mask:
        return ()
    reasons = []
    if mask & THERMAL_BITS:
        reasons.append("thermal")
    if mask & POWER_BITS:
        reasons.append("power")
    return tuple(reasons)


def processes_from_raw(*lists: Iterable[Any]) -> tuple[GpuProcess, ...]:
    """NVML process infos (compute, graphics) as one entry per pid, sorted by pid.

    `usedGpuMemory` is None where NVML cannot tell (WDDM, some MIG setups): such a process
    still holds a context on the GPU and is listed, with 0 MB. A pid in several lists keeps
    the largest figure (NVML reports the same allocation in each).
    """
    memory: dict[int, int] = {}
    for infos in lists:
        for info in infos:
            used = getattr(info, "usedGpuMemory", None)
            mb = int(used) // MIB if used is not None else 0
            pid = int(info.pid)
            memory[pid] = max(mb, memory.get(pid, 0))
    return tuple(GpuProcess(pid=pid, memory_mb=mb) for pid, mb in sorted(memory.items()))


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """The raw values of one GPU reading; None where NVML did not give one."""

    index: int
    utilization_gpu: int | float | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    temperature_c: int | float | None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    throttle_mask: int | None = None
    energy_mj: int | None = None
    processes: tuple[GpuProcess, ...] = ()

    @property
    def missing(self) -> frozenset[str]:
        """Readings a GpuSample cannot leave empty, reported as 0 here: say which, so no one
        mistakes them for measurements (a 0 % that is not known must not look idle)."""
        names = {"utilization": self.utilization_gpu, "memory": self.memory_used_bytes,
                 "temperature": self.temperature_c}
        return frozenset(name for name, value in names.items() if value is None)


def gpu_sample_from_reading(reading: NvmlReading) -> GpuSample:
    r = reading
    return GpuSample(
        index=r.index,
        utilization_pct=float(r.utilization_gpu or 0),
        memory_used_mb=int(r.memory_used_bytes or 0) // MIB,
        temperature_c=float(r.temperature_c or 0),
        power_w=None if r.power_mw is None else round(r.power_mw / 1000.0, 1),
        memory_total_mb=int(r.memory_total_bytes or 0) // MIB,
        power_limit_w=None if r.power_limit_mw is None else round(r.power_limit_mw / 1000.0, 1),
        throttle=throttle_from_mask(r.throttle_mask),
        energy_j=None if r.energy_mj is None else r.energy_mj / 1000.0,
        processes=r.processes,
        simulated=False,
    )


def gpu_sample_from_raw(index: int, utilization_gpu: int | float, memory_used_bytes: int,
                        temperature_c: int | float, power_mw: int | None) -> GpuSample:
    """The basic reading (what `nvidia-smi --query-gpu=...` shows) as a GpuSample."""
    return gpu_sample_from_reading(NvmlReading(
        index=index, utilization_gpu=utilization_gpu, memory_total_bytes=None,
        memory_used_bytes=memory_used_bytes, temperature_c=temperature_c, power_mw=power_mw))


def probe(lib: NvmlLib) -> tuple[list[NvmlHandle], str]:
    """Initialise NVML and return its device handles, or none and the reason why."""
    try:
        lib.nvmlInit()
    except NVML_ERRORS as exc:
        return [], f"NVML is not available ({exc})"
    try:
        count = int(lib.nvmlDeviceGetCount())
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except NVML_ERRORS as exc:
        shutdown(lib)
        return [], f"NVML could not list GPUs ({exc})"
    if not handles:
        shutdown(lib)
        return [], "NVML found no NVIDIA GPU"
    return handles, ""


def shutdown(lib: NvmlLib) -> None:
    with contextlib.suppress(*NVML_ERRORS):  # shutting down: nothing left to do
        lib.nvmlShutdown()


def read_info(lib: NvmlLib, handle: NvmlHandle, index: int) -> GpuInfo:
    """What the node registers about one GPU: name, uuid, total memory."""
    memory = lib.nvmlDeviceGetMemoryInfo(handle)
    return gpu_info_from_raw(index, lib.nvmlDeviceGetName(handle),
                             lib.nvmlDeviceGetUUID(handle), memory.total)


def read_platform(lib: NvmlLib) -> Platform:
    """Driver, CUDA (the newest the driver supports) and NVML versions; "" for any this
    driver does not answer."""
    driver = _optional(lib.nvmlSystemGetDriverVersion)
    cuda_call = _named(lib, "nvmlSystemGetCudaDriverVersion_v2",
                       "nvmlSystemGetCudaDriverVersion")
    cuda = _optional(cuda_call) if cuda_call is not None else None
    nvml_call = _named(lib, "nvmlSystemGetNVMLVersion")
    nvml = _optional(nvml_call) if nvml_call is not None else None
    return Platform(driver=text(driver) if driver is not None else "",
                    cuda=cuda_from_nvml(int(cuda)) if cuda else "",
                    nvml=text(nvml) if nvml is not None else "")


def _optional(call: Callable[[], T]) -> T | None:
    """One NVML query; None when this GPU or driver does not answer it."""
    try:
        return call()
    except NVML_ERRORS:
        return None


def _named(lib: NvmlLib, *names: str) -> Callable[..., Any] | None:
    """The first of these NVML functions this pynvml release has (names change)."""
    return next((getattr(lib, n) for n in names if hasattr(lib, n)), None)


def _throttle_mask(lib: NvmlLib, handle: NvmlHandle) -> int | None:
    # ...EventReasons since driver 535; ...ThrottleReasons before (deprecated, not removed).
    for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksThrottleReasons"):
        query: Callable[[NvmlHandle], Any] | None = getattr(lib, name, None)
        if query is None:
            continue
        try:
            return int(query(handle))
        except NVML_ERRORS:
            continue
    return None


def _process_list(lib: NvmlLib, handle: NvmlHandle, *names: str) -> list[Any]:
    query = _named(lib, *names)
    if query is None:
        return []
    return list(_optional(lambda: query(handle)) or [])


def read_reading(lib: NvmlLib, handle: NvmlHandle, index: int) -> NvmlReading:
    """Every value m27 samples of one GPU, each query on its own (one may be unsupported)."""
    utilization = _optional(lambda: lib.nvmlDeviceGetUtilizationRates(handle))
    memory = _optional(lambda: lib.nvmlDeviceGetMemoryInfo(handle))
    compute = _process_list(lib, handle, "nvmlDeviceGetComputeRunningProcesses")
    graphics = _process_list(lib, handle, "nvmlDeviceGetGraphicsRunningProcesses")
    return NvmlReading(
        index=index,
        utilization_gpu=None if utilization is None else utilization.gpu,
        memory_total_bytes=None if memory is None else int(memory.total),
        memory_used_bytes=None if memory is None else int(memory.used),
        temperature_c=_optional(
            lambda: lib.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        power_mw=_optional(lambda: int(lib.nvmlDeviceGetPowerUsage(handle))),
        power_limit_mw=_optional(lambda: int(lib.nvmlDeviceGetEnforcedPowerLimit(handle))),
        throttle_mask=_throttle_mask(lib, handle),
        energy_mj=_optional(lambda: int(lib.nvmlDeviceGetTotalEnergyConsumption(handle))),
        processes=processes_from_raw(compute, graphics),
    )


def read_sample(lib: NvmlLib, handle: NvmlHandle, index: int) -> GpuSample:
    """One reading, as `nvidia-smi --query-gpu=utilization.gpu,memory.used,...` shows it,
    plus power limit, throttle reasons, energy and the processes holding memory."""
    return gpu_sample_from_reading(read_reading(lib, handle, index))
