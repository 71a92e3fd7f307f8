"""The node's telemetry for Prometheus: text exposition (format 0.0.4) with the names and
labels NVIDIA's DCGM exporter uses, so existing GPU dashboards work unchanged, plus m27's
per-task series; and a minimal HTTP/1.1 server that answers `GET /metrics`.

Simulated GPUs carry `m27_simulated="true"` on every series: a dashboard can never take
them for hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from m27.common.logging import get_logger
from m27.common.model import GpuBackend, GpuInfo, GpuSample, TaskHolding
from m27.node_agent._gpus import per_gpu_share
from m27.node_agent._nvml import SW_POWER_CAP, SW_THERMAL_SLOWDOWN

log = get_logger()

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MIB: Final = 1024 * 1024
#: m27's throttle reasons as the DCGM/NVML clocks-event bits they stand for (the raw mask
#: is not kept in a sample; SW bits are the ones both hardware and the simulator set).
THROTTLE_BITS: Final = {"power": SW_POWER_CAP, "thermal": SW_THERMAL_SLOWDOWN}
REQUEST_TIMEOUT_S: Final = 10.0
MAX_REQUEST_BYTES: Final = 16 * 1024

# name → (type, help). DCGM's own names where DCGM has the field.
_FAMILIES: Final = {
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


def escape(value: str) -> str:
    """A label value as the exposition format wants it: backslash, quote, newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


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
        labels = _labels(_gpu_labels(gpu, hostname, node_id))
        missing = (unmeasured or {}).get(sample.index, frozenset())
        for name, value in _gpu_values(sample, gpu).items():
            if value is not None and _NEEDS.get(name) not in missing:
                series[name].append(f"{name}{labels} {_number(value)}")
    _task_series(series, node_id, simulated, samples, holdings, task_energy)
    lines: list[str] = []
    for name, (kind, text) in _FAMILIES.items():
        if series[name]:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *series[name]]
    return "\n".join(lines) + "\n" if lines else ""


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
            labels = _labels({"task_id": holding.task_id, "attempt": str(holding.attempt),
                              "gpu": str(gpu), "m27_node": node_id, "m27_simulated": sim})
            series["m27_task_gpu_share"].append(f"m27_task_gpu_share{labels} {_number(share)}")
    for (task_id, attempt, gpu), mb in sorted(memory.items()):
        labels = _labels({"task_id": task_id, "attempt": str(attempt), "gpu": str(gpu),
                          "m27_node": node_id, "m27_simulated": sim})
        series["m27_task_gpu_memory_used_bytes"].append(
            f"m27_task_gpu_memory_used_bytes{labels} {mb * MIB}")
    for (task_id, attempt), joules in sorted(task_energy.items()):
        labels = _labels({"task_id": task_id, "attempt": str(attempt), "m27_node": node_id,
                          "m27_simulated": sim})
        series["m27_task_energy_joules"].append(
            f"m27_task_energy_joules{labels} {_number(round(joules, 3))}")


# ---------------------------------------------------------------- HTTP


def split_bind(bind: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces); ValueError otherwise."""
    host, sep, port = bind.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {bind!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - ":port" means every one


def _response(status: str, body: bytes, content_type: str, head_only: bool) -> bytes:
    header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return header + (b"" if head_only else body)


class MetricsServer:
    """`GET /metrics` → 200 with `render()`'s text; any other path 404, other methods 405.
    One request per connection; slow or oversized requests are dropped."""

    def __init__(self, bind: str, render: Callable[[], str]) -> None:
        self._host, self._port = split_bind(bind)
        self._render = render
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Listen; the address it listens on as `host:port` (the real port for port 0)."""
        self._server = await asyncio.start_server(self._handle, self._host, self._port,
                                                  limit=MAX_REQUEST_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            try:
                answer = self._answer(await asyncio.wait_for(_read_request(reader),
                                                             REQUEST_TIMEOUT_S))
            except (ValueError, asyncio.LimitOverrunError):
                answer = _response("400 Bad Request", b"bad request\n",
                                   "text/plain; charset=utf-8", False)
            writer.write(answer)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that is too slow or goes away gets its connection closed
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _answer(self, request: tuple[str, str]) -> bytes:
        method, target = request
        path = target.split("?", 1)[0]
        text_type = "text/plain; charset=utf-8"
        if path != "/metrics":
            return _response("404 Not Found", b"not found; try /metrics\n", text_type,
                             method == "HEAD")
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"GET only\n", text_type, False)
        try:
            body = self._render().encode()
        except Exception as exc:  # a bug in rendering must not take the endpoint down
            log.exception("metrics.render_failed", error=str(exc))
            return _response("500 Internal Server Error", b"render failed\n", text_type,
                             method == "HEAD")
        return _response("200 OK", body, CONTENT_TYPE, method == "HEAD")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and target of one request; its headers are read and ignored."""
    line = (await reader.readuntil(b"\r\n")).decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request")
    total = len(line)
    while (header := await reader.readuntil(b"\r\n")) != b"\r\n":
        total += len(header)
        if total > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return parts[0], parts[1]
