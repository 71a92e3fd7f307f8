"""The node's GPU backend: real GPUs through NVML, simulated GPUs, or none.

A backend knows its GPUs and takes one reading of each per heartbeat. Which one a node gets
is decided once, at start, from the `--gpus` spec (`open_backend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pynvml

from m27.common.model import GpuBackend, GpuInfo, GpuSample
from m27.node_agent import _nvml
from m27.node_agent._gpus import GpuSpec, Holding, gpu_loads, simulated_gpus, simulated_samples


class Backend(Protocol):
    """What the agent needs from a GPU backend."""

    @property
    def kind(self) -> GpuBackend: ...

    @property
    def gpus(self) -> tuple[GpuInfo, ...]: ...

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]: ...

    def close(self) -> None: ...


class NoGpus:
    """A CPU-only node."""

    kind: GpuBackend = "none"
    gpus: tuple[GpuInfo, ...] = ()

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        return ()

    def close(self) -> None:
        return None


class SimulatedGpus:
    """GPUs that exist only in m27's model: load from the shares tasks hold, lagging heat."""

    kind: GpuBackend = "simulated"

    def __init__(self, gpus: tuple[GpuInfo, ...]) -> None:
        self.gpus = gpus
        self._last: dict[int, GpuSample] = {}
        self._last_at: float | None = None

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        dt = 0.0 if self._last_at is None else now - self._last_at
        samples = simulated_samples(self.gpus, gpu_loads(holdings), self._last, dt)
        self._last = {s.index: s for s in samples}
        self._last_at = now
        return samples

    def close(self) -> None:
        return None


class NvmlGpus:
    """Real NVIDIA GPUs, read through NVML (what `nvidia-smi` shows)."""

    kind: GpuBackend = "nvml"

    def __init__(self, lib: _nvml.NvmlLib, handles: list[_nvml.NvmlHandle]) -> None:
        self._lib = lib
        self._handles = handles
        self.gpus = tuple(_nvml.read_info(lib, h, i) for i, h in enumerate(handles))

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        return tuple(_nvml.read_sample(self._lib, h, i) for i, h in enumerate(self._handles))

    def close(self) -> None:
        _nvml.shutdown(self._lib)


def open_backend(spec: GpuSpec, node_id: str,
                 lib: _nvml.NvmlLib = pynvml) -> tuple[Backend, str]:
    """The backend `spec` asks for, and a sentence saying what was chosen and why."""
    if spec.mode == "none":
        return NoGpus(), "no GPUs (--gpus none)"
    if spec.mode == "sim":
        gpus = simulated_gpus(node_id, spec)
        return SimulatedGpus(gpus), (
            f"SIMULATED GPUs: {spec.count} x {spec.memory_mb} MiB, not real hardware "
            f"(--gpus sim:{spec.count})")
    handles, why = _nvml.probe(lib)
    if not handles:
        return NoGpus(), (f"no GPUs: {why}; running CPU tasks only "
                          "(--gpus sim:N simulates N GPUs)")
    try:
        backend = NvmlGpus(lib, handles)
    except pynvml.NVMLError as exc:
        _nvml.shutdown(lib)
        return NoGpus(), (f"no GPUs: NVML could not read them ({exc}); running CPU tasks "
                          "only (--gpus sim:N simulates N GPUs)")
    names = ", ".join(sorted({g.name for g in backend.gpus}))
    return backend, f"{len(handles)} NVIDIA GPU(s) through NVML: {names}"
