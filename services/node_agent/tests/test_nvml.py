"""NVML readings become m27 records (a fake NVML stands in for the GPU), and backend choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from m27.common.model import GpuInfo, GpuSample
from m27.node_agent import _nvml
from m27.node_agent._agent import _log_backend
from m27.node_agent._backends import NoGpus, NvmlGpus, SimulatedGpus, open_backend
from m27.node_agent._gpus import GpuSpec, Holding

GIB = 1024 ** 3


@dataclass
class _Memory:
    total: int
    used: int


@dataclass
class _Utilization:
    gpu: int
    memory: int = 0


@dataclass
class FakeDevice:
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    uuid: str | bytes = "GPU-1234"
    total: int = 80 * GIB
    used: int = 10 * GIB
    util: int = 87
    temp: int = 64
    power_mw: int | None = 312_456


@dataclass
class FakeNvml:
    """The few pynvml functions the agent calls, over fake devices."""

    devices: list[FakeDevice] = field(default_factory=list)
    init_error: int | None = None
    calls: list[str] = field(default_factory=list)

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> _Memory:
        return _Memory(total=handle.total, used=handle.used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> _Utilization:
        return _Utilization(gpu=handle.util)

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return handle.temp

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        if handle.power_mw is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle.power_mw


@pytest.mark.parametrize(("name", "uuid"), [
    ("NVIDIA A100-SXM4-40GB", "GPU-abc"), (b"Tesla V100-SXM2-16GB", b"GPU-def"),
])
def test_info_from_nvml_values(name: str | bytes, uuid: str | bytes) -> None:
    lib = FakeNvml()
    device = FakeDevice(name=name, uuid=uuid, total=16 * GIB + 5)
    info = _nvml.read_info(lib, device, 3)
    assert info == GpuInfo(index=3, name=_nvml.text(name), uuid=_nvml.text(uuid),
                           memory_total_mb=16384, simulated=False)
    assert isinstance(info.name, str)


@pytest.mark.parametrize(("device", "expected"), [
    (FakeDevice(), GpuSample(index=0, utilization_pct=87.0, memory_used_mb=10240,
                             temperature_c=64.0, power_w=312.5)),
    (FakeDevice(power_mw=None, util=0, used=0, temp=31),
     GpuSample(index=0, utilization_pct=0.0, memory_used_mb=0, temperature_c=31.0,
               power_w=None)),
])
def test_sample_from_nvml_values(device: FakeDevice, expected: GpuSample) -> None:
    assert _nvml.read_sample(FakeNvml(), device, 0) == expected


def test_auto_uses_nvml_when_it_finds_gpus() -> None:
    lib = FakeNvml(devices=[FakeDevice(uuid="GPU-0"), FakeDevice(uuid="GPU-1")])
    backend, why = open_backend(GpuSpec(mode="auto"), "n1", lib)
    assert isinstance(backend, NvmlGpus)
    assert backend.kind == "nvml"
    assert [g.uuid for g in backend.gpus] == ["GPU-0", "GPU-1"]
    assert not any(g.simulated for g in backend.gpus)
    assert "NVML" in why
    assert [s.index for s in backend.sample([], 0.0)] == [0, 1]
    backend.close()
    assert lib.calls[-1] == "shutdown"


@pytest.mark.parametrize(("lib", "why"), [
    (FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), "not available"),
    (FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "not available"),
    (FakeNvml(devices=[]), "no NVIDIA GPU"),
])
def test_auto_without_gpus_runs_cpu_only_and_says_how_to_simulate(lib: Any, why: str) -> None:
    backend, detail = open_backend(GpuSpec(mode="auto"), "n1", lib)
    assert isinstance(backend, NoGpus)
    assert backend.kind == "none"
    assert why in detail
    assert "--gpus sim:N" in detail


def test_none_and_sim_never_touch_nvml() -> None:
    lib = FakeNvml(devices=[FakeDevice()])
    none, _ = open_backend(GpuSpec(mode="none"), "n1", lib)
    sim, why = open_backend(GpuSpec(mode="sim", count=2, memory_mb=1024), "n1", lib)
    assert lib.calls == []
    assert none.kind == "none"
    assert none.gpus == ()
    assert isinstance(sim, SimulatedGpus)
    assert sim.kind == "simulated"
    assert "SIMULATED" in why
    assert all(g.simulated for g in sim.gpus)


def test_simulated_backend_samples_the_load_of_running_tasks() -> None:
    sim, _ = open_backend(GpuSpec(mode="sim", count=2, memory_mb=1000), "n1")
    first = sim.sample([Holding(gpu_ids=(1,), gpu_share=0.5)], now=100.0)
    second = sim.sample([Holding(gpu_ids=(1,), gpu_share=0.5)], now=105.0)
    assert [s.utilization_pct for s in first] == [0.0, 50.0]
    assert second[1].temperature_c > first[1].temperature_c
    assert second[0].temperature_c == first[0].temperature_c


def test_the_start_log_says_simulated_when_it_is() -> None:
    sim, why = open_backend(GpuSpec(mode="sim", count=2, memory_mb=1024), "n1")
    none, why_none = open_backend(GpuSpec(mode="none"), "n1")
    with capture_logs() as logs:
        _log_backend(sim, why)
        _log_backend(none, why_none)
    assert [(e["backend"], e["simulated"]) for e in logs] == [("simulated", True),
                                                              ("none", False)]
    assert "SIMULATED" in logs[0]["detail"]
    assert logs[0]["log_level"] == "warning"
