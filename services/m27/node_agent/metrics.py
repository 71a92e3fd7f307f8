"""The node's telemetry for Prometheus: text exposition (format 0.0.4) with the names and
labels NVIDIA's DCGM exporter uses, so existing GPU dashboards work unchanged, plus m27's
per-task series. (The format's helpers and the `GET /metrics` server are shared:
`m27.common.metrics`.)

Simulated GPUs carry `m27_simulated="true"` on every series: a dashboard can never take
them for hardware.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from m27.common.metrics import Kind, format_labels, number, render_families
from m27.common.model import GpuBackend, GpuInfo, GpuSample, TaskHolding, per_gpu_share
from m27.node_agent._nvml import SW_POWER_CAP, SW_THERMAL_SLOWDOWN

MIB: Final = 1024 * 1024
#: m27's throttle reasons as the DCGM/NVML clocks-event bits they stand for (the raw mask
#: is not kept in a sample; SW bits are the ones both hardware and the simulator set).
THROTTLE_BITS: Final = {"power": SW_POWER_CAP, "thermal": SW_THERMAL_SLOWDOWN}

# name → (type, help). DCGM's own names where DCGM has the field.
_FAMILIES: Final[dict[str, tuple[Kind, str]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (%)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "GPU framebuffer memory used (MiB)."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "GPU framebuffer memory free (MiB)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "GPU power draw (W)."),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("gauge", "GPU enforced power limit (W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "counter", "GPU energy since the driver loaded (NVML) or the agent started (mJ)."),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (
        "gauge", "GPU clocks throttle reasons (NVML bitmask: 4 power cap, 32 thermal)."),
    "m27_task_gpu_share": ("gauge", "Share of each GPU a running m27 task holds."),
    "m27_task_gpu_memory_used_bytes": (
        "gauge", "GPU memory the processes of an m27 task hold on a GPU."),
    "m27_task_energy_joules": (
        "counter", "GPU energy attributed to an m27 task (its share of its GPUs)."),
}


def _gpu_labels(gpu: GpuInfo, hostname: str, node_id: str) -> dict[str, str]:
    return {"gpu": str(gpu.index), "UUID": gpu.uuid, "device": f"nvidia{gpu.index}",
            "modelName": gpu.name, "Hostname": hostname, "m27_node": node_id,
            "m27_simulated": "true" if gpu.simulated else "false"}


def _gpu_values(sample: GpuSample, gpu: GpuInfo) -> dict[str, float | None]:
    total = sample.memory_total_mb or gpu.memory_total_mb
    return {
        "DCGM_FI_DEV_GPU_UTIL": sample.utilization_pct,
        "DCGM_FI_DEV_FB_USED": sample.memory_used_mb,
        "DCGM_FI_DEV_FB_FREE": max(0, total - sample.memory_used_mb) if total else None,
        "DCGM_FI_DEV_GPU_TEMP": sample.temperature_c,
        "DCGM_FI_DEV_POWER_USAGE": sample.power_w,
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": sample.power_limit_w,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":
            None if sample.energy_j is None else round(sample.energy_j * 1000.0),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS":
            sum(THROTTLE_BITS.get(reason, 0) for reason in set(sample.throttle)),
    }


#: Series left out when the hardware did not give the reading (see `NvmlReading.missing`).
_NEEDS: Final = {"DCGM_FI_DEV_GPU_UTIL": "utilization", "DCGM_FI_DEV_GPU_TEMP": "temperature",
                 "DCGM_FI_DEV_FB_USED": "memory", "DCGM_FI_DEV_FB_FREE": "memory"}


def render(node_id: str, hostname: str, backend: GpuBackend, gpus: Sequence[GpuInfo],
           samples: Sequence[GpuSample], holdings: Sequence[TaskHolding],
           task_energy: Mapping[tuple[str, int], float],
           unmeasured: Mapping[int, frozenset[str]] | None = None) -> str:
    """The text a Prometheus scrape of this node gets (families in a fixed order).

    A reading the GPU did not give is left out, never exported as 0."""
    series: dict[str, list[str]] = {name: [] for name in _FAMILIES}
    info = {g.index: g for g in gpus}
    simulated = backend == "simulated"
    for sample in samples:
        gpu = info.get(sample.index) or GpuInfo(index=sample.index, name="", uuid="",
                                                memory_total_mb=0, simulated=sample.simulated)
        tags = format_labels(_gpu_labels(gpu, hostname, node_id))
        missing = (unmeasured or {}).get(sample.index, frozenset())
        for name, value in _gpu_values(sample, gpu).items():
            if value is not None and _NEEDS.get(name) not in missing:
                series[name].append(f"{name}{tags} {number(value)}")
    _task_series(series, node_id, simulated, samples, holdings, task_energy)
    return render_families(_FAMILIES, series)


def _task_series(series: dict[str, list[str]], node_id: str, simulated: bool,
                 samples: Sequence[GpuSample], holdings: Sequence[TaskHolding],
                 task_energy: Mapping[tuple[str, int], float]) -> None:
    sim = "true" if simulated else "false"
    memory: dict[tuple[str, int, int], int] = {}
    for sample in samples:
        for proc in sample.processes:
            if proc.task_id:
                key = (proc.task_id, proc.attempt, sample.index)
                memory[key] = memory.get(key, 0) + proc.memory_mb
    for holding in holdings:
        share = per_gpu_share(holding.gpu_ids, holding.gpu_share)
        for gpu in holding.gpu_ids:
            tags = format_labels({"task_id": holding.task_id, "attempt": str(holding.attempt),
                              "gpu": str(gpu), "m27_node": node_id, "m27_simulated": sim})
            series["m27_task_gpu_share"].append(f"m27_task_gpu_share{tags} {number(share)}")
    for (task_id, attempt, gpu), mb in sorted(memory.items()):
        tags = format_labels({"task_id": task_id, "attempt": str(attempt), "gpu": str(gpu),
                          "m27_node": node_id, "m27_simulated": sim})
        series["m27_task_gpu_memory_used_bytes"].append(
            f"m27_task_gpu_memory_used_bytes{tags} {mb * MIB}")
    for (task_id, attempt), joules in sorted(task_energy.items()):
        tags = format_labels({"task_id": task_id, "attempt": str(attempt), "m27_node": node_id,
                          "m27_simulated": sim})
        series["m27_task_energy_joules"].append(
            f"m27_task_energy_joules{tags} {number(round(joules, 3))}")
