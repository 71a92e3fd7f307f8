"""NVML, kept thin: a few calls through a `lib` object (the pynvml module in production, a
fake in tests) and pure conversions of their raw values into `GpuInfo` / `GpuSample`.

NVML reports memory in bytes and power in milliwatts; m27 records use MB and W.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

import pynvml

from m27.common.model import GpuInfo, GpuSample

MIB: Final = 1024 * 1024

#: The pynvml module, or anything with the same functions (tests pass a fake).
NvmlLib = Any
NvmlHandle = Any


def text(value: str | bytes) -> str:
    """NVML strings are bytes in older pynvml releases and str in newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def gpu_info_from_raw(index: int, name: str | bytes, uuid: str | bytes,
                      memory_total_bytes: int) -> GpuInfo:
    return GpuInfo(index=index, name=text(name), uuid=text(uuid),
                   memory_total_mb=int(memory_total_bytes) // MIB, simulated=False)


def gpu_sample_from_raw(index: int, utilization_gpu: int | float, memory_used_bytes: int,
                        temperature_c: int | float, power_mw: int | None) -> GpuSample:
    return GpuSample(
        index=index,
        utilization_pct=float(utilization_gpu),
        memory_used_mb=int(memory_used_bytes) // MIB,
        temperature_c=float(temperature_c),
        power_w=None if power_mw is None else round(power_mw / 1000.0, 1),
    )


def probe(lib: NvmlLib) -> tuple[list[NvmlHandle], str]:
    """Initialise NVML and return its device handles, or none and the reason why."""
    try:
        lib.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML is not available ({exc})"
    try:
        count = int(lib.nvmlDeviceGetCount())
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except pynvml.NVMLError as exc:
        shutdown(lib)
        return [], f"NVML could not list GPUs ({exc})"
    if not handles:
        shutdown(lib)
        return [], "NVML found no NVIDIA GPU"
    return handles, ""


def shutdown(lib: NvmlLib) -> None:
    with contextlib.suppress(pynvml.NVMLError):  # shutting down: nothing left to do
        lib.nvmlShutdown()


def read_info(lib: NvmlLib, handle: NvmlHandle, index: int) -> GpuInfo:
    """What the node registers about one GPU: name, uuid, total memory."""
    memory = lib.nvmlDeviceGetMemoryInfo(handle)
    return gpu_info_from_raw(index, lib.nvmlDeviceGetName(handle),
                             lib.nvmlDeviceGetUUID(handle), memory.total)


def read_sample(lib: NvmlLib, handle: NvmlHandle, index: int) -> GpuSample:
    """One reading, as `nvidia-smi --query-gpu=utilization.gpu,memory.used,...` shows it.

    Power is optional: many boards (and MIG slices) do not report it.
    """
    utilization = lib.nvmlDeviceGetUtilizationRates(handle)
    memory = lib.nvmlDeviceGetMemoryInfo(handle)
    temperature = lib.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    try:
        power_mw: int | None = int(lib.nvmlDeviceGetPowerUsage(handle))
    except pynvml.NVMLError:
        power_mw = None
    return gpu_sample_from_raw(index, utilization.gpu, memory.used, temperature, power_mw)
