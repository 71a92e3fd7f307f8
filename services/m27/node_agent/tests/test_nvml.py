"""NVML readings become m27 records, and backend choice.

No GPU is here: a fake NVML (the pynvml functions the agent calls) stands in for one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from m27.common.model import GpuInfo, GpuProcess, GpuSample
from m27.common.platform import Platform
from m27.node_agent import _nvml
from m27.node_agent._backends import (
    NoGpus,
    NvmlGpus,
    SimulatedGpus,
    TaskEnv,
    open_backend,
    parse_environ,
    parse_stat,
)
from m27.node_agent._gpus import GpuSpec, Holding, simulated_gpus
from m27.node_agent.service import _log_backend

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
class _Process:
    pid: int
    usedGpuMemory: int | None  # NVML's field name


def _unsupported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@dataclass
class FakeDevice:
    """One GPU; a None reading answers NotSupported, as boards and MIG setups do."""

    name: str | bytes = "NVIDIA H100 80GB HBM3"
    uuid: str | bytes = "GPU-1234"
    total: int = 80 * GIB
    used: int | None = 10 * GIB
    util: int | None = 87
    temp: int | None = 64
    power_mw: int | None = 312_456
    limit_mw: int | None = 700_000
    reasons: int | None = 0
    energy_mj: int | None = 123_456_789
    compute: list[_Process] | None = field(default_factory=list)
    graphics: list[_Process] | None = field(default_factory=list)


def _answer(value: Any) -> Any:
    if value is None:
        raise _unsupported()
    return value


@dataclass
class FakeNvml:
    """The few pynvml functions the agent calls, over fake devices (no GPU is here)."""

    devices: list[FakeDevice] = field(default_factory=list)
    init_error: int | None = None
    calls: list[str] = field(default_factory=list)
    driver: str | bytes | None = "550.54.15"
    cuda: int | None = 12040
    nvml: str | bytes | None = "12.550.54.15"

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return _answer(self.driver)  # type: ignore[no-any-return]

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(_answer(self.cuda))

    def nvmlSystemGetNVMLVersion(self) -> str | bytes:
        return _answer(self.nvml)  # type: ignore[no-any-return]

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
        return _Memory(total=handle.total, used=_answer(handle.used))

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> _Utilization:
        return _Utilization(gpu=_answer(handle.util))

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(_answer(handle.temp))

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        return int(_answer(handle.power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        return int(_answer(handle.limit_mw))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeDevice) -> int:
        return int(_answer(handle.reasons))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:
        return int(_answer(handle.energy_mj))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[_Process]:
        return list(_answer(handle.compute))

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[_Process]:
        return list(_answer(handle.graphics))


class OldNvml(FakeNvml):
    """A pynvml from before driver 535: throttle reasons under their old name only."""

    def __getattribute__(self, name: str) -> Any:
        if name == "nvmlDeviceGetCurrentClocksEventReasons":
            raise AttributeError(name)
        return super().__getattribute__(name)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeDevice) -> int:
        return int(_answer(handle.reasons))


class MismatchedNvml(FakeNvml):
    """pynvml newer than the driver: its unversioned process queries raise a mismatch."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[_Process]:
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")


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
                             temperature_c=64.0, power_w=312.5, memory_total_mb=81920,
                             power_limit_w=700.0, energy_j=123456.789)),
    (FakeDevice(power_mw=None, util=0, used=0, temp=31, limit_mw=None, energy_mj=None),
     GpuSample(index=0, utilization_pct=0.0, memory_used_mb=0, temperature_c=31.0,
               power_w=None, memory_total_mb=81920)),
])
def test_sample_from_nvml_values(device: FakeDevice, expected: GpuSample) -> None:
    assert _nvml.read_sample(FakeNvml(), device, 0) == expected


@pytest.mark.parametrize(("mask", "reasons"), [
    (0, ()),
    (None, ()),
    (pynvml.nvmlClocksEventReasonGpuIdle, ()),
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, ()),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, ("thermal",)),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, ("thermal",)),
    (pynvml.nvmlClocksEventReasonSwPowerCap, ("power",)),
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, ("power",)),
    (pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
     | pynvml.nvmlClocksEventReasonGpuIdle, ("thermal", "power")),
])
def test_throttle_reasons_from_the_nvml_bitmask(mask: int | None,
                                                reasons: tuple[str, ...]) -> None:
    assert _nvml.throttle_from_mask(mask) == reasons
    device = FakeDevice(reasons=mask)
    assert _nvml.read_sample(FakeNvml(), device, 0).throttle == reasons
    assert _nvml.read_sample(OldNvml(), device, 0).throttle == reasons


def test_processes_are_listed_once_per_pid_with_their_memory() -> None:
    device = FakeDevice(compute=[_Process(30, 2 * GIB), _Process(10, None)],
                        graphics=[_Process(30, GIB), _Process(20, 512 * 1024 * 1024)])
    assert _nvml.read_sample(FakeNvml(), device, 0).processes == (
        GpuProcess(pid=10, memory_mb=0),  # memory not known (WDDM, MIG): still listed
        GpuProcess(pid=20, memory_mb=512),
        GpuProcess(pid=30, memory_mb=2048),
    )


@pytest.mark.parametrize("lib", [FakeNvml(), OldNvml(), MismatchedNvml()])
def test_every_unsupported_query_degrades_and_never_fails_the_sample(lib: FakeNvml) -> None:
    device = FakeDevice(used=None, util=None, temp=None, power_mw=None, limit_mw=None,
                        reasons=None, energy_mj=None, compute=None, graphics=None)
    reading = _nvml.read_reading(lib, device, 2)
    assert reading.missing == {"utilization", "memory", "temperature"}
    sample = _nvml.gpu_sample_from_reading(reading)
    assert sample == GpuSample(index=2, utilization_pct=0.0, memory_used_mb=0,
                               temperature_c=0.0, memory_total_mb=0)


def test_a_backend_says_which_readings_its_gpus_do_not_give() -> None:
    lib = FakeNvml(devices=[FakeDevice(util=None), FakeDevice()])
    backend, _ = open_backend(GpuSpec(mode="auto"), "n1", lib)
    backend.sample([], 0.0)
    assert backend.unmeasured() == {0: frozenset({"utilization"})}
    assert backend.task_utilization() == {}


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


def test_the_driver_cuda_and_nvml_versions_are_read_or_left_unknown() -> None:
    lib = FakeNvml(devices=[FakeDevice()], driver=b"535.104.05", cuda=12020)
    backend, why = open_backend(GpuSpec(mode="auto"), "n1", lib)
    assert backend.platform == Platform(driver="535.104.05", cuda="12.2", nvml="12.550.54.15")
    assert "driver 535.104.05, CUDA 12.2" in why
    backend.close()
    silent = FakeNvml(devices=[FakeDevice()], driver=None, cuda=None, nvml=None)
    backend, why = open_backend(GpuSpec(mode="auto"), "n1", silent)
    assert backend.platform == Platform()
    assert "driver unknown, CUDA unknown" in why
    backend.close()


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


def test_simulated_backend_models_holdings_without_a_process_group_from_their_booking(
        ) -> None:
    sim, _ = open_backend(GpuSpec(mode="sim", count=2, memory_mb=1000), "n1")
    first = sim.sample([Holding(gpu_ids=(1,), gpu_share=0.5)], now=100.0)
    second = sim.sample([Holding(gpu_ids=(1,), gpu_share=0.5)], now=105.0)
    assert [s.utilization_pct for s in first] == [0.0, 50.0]
    assert [s.memory_used_mb for s in first] == [0, 500]
    assert second[1].temperature_c > first[1].temperature_c
    assert second[0].temperature_c == first[0].temperature_c
    assert all(s.simulated for s in first + second)


# ---------------------------------------------------------------- processes to tasks


def fake_proc(root: Path, processes: dict[int, dict[str, Any]], uptime: float = 1000.0) -> Path:
    """A /proc tree: pid → pgid, ticks (utime), start (ticks), rss (pages), env, comm."""
    root.mkdir(exist_ok=True)
    (root / "uptime").write_text(f"{uptime} 0.0\n")
    for pid, p in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", "1", str(p.get("pgid", pid))] + ["0"] * 8 + [
            str(p.get("ticks", 0)), "0", "0", "0"] + ["0"] * 4 + [
            str(p.get("start", 0)), "0", str(p.get("rss", 0))] + ["0"] * 20
        comm = p.get("comm", "python")
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields))
        env = p.get("env", {})
        (root / str(pid) / "environ").write_bytes(
            b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    return root


def env_of(task_id: str, attempt: int, node: str = "n1", gpus: str = "0") -> dict[str, str]:
    return {"PATH": "/bin", "M27_TASK_ID": task_id, "M27_ATTEMPT": str(attempt),
            "M27_NODE_ID": node, "M27_GPU_IDS": gpus}


def test_nvml_processes_are_mapped_to_the_task_that_owns_them(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {
        100: {},  # a running task's main process
        101: {"pgid": 100},  # and its child
        200: {"pgid": 200, "env": env_of("r/left", 1)},  # left its group, env says whose
        300: {"env": env_of("r/other", 1, node="n2")},  # another node's: not ours
        400: {},  # no m27 task at all
    })
    device = FakeDevice(compute=[_Process(p, GIB) for p in (101, 100, 200, 300, 400, 999)])
    backend = NvmlGpus(FakeNvml(devices=[device]), [device], "n1", proc)
    holdings = [Holding(gpu_ids=(0,), gpu_share=1.0, task_id="r/main", attempt=2, pgid=100)]
    owners = {p.pid: (p.task_id, p.attempt) for p in backend.sample(holdings, 0)[0].processes}
    assert owners == {100: ("r/main", 2), 101: ("r/main", 2), 200: ("r/left", 1),
                      300: ("", 0), 400: ("", 0), 999: ("", 0)}


@pytest.mark.parametrize(("raw", "expected"), [
    (b"42 (a) b) S 1 40 40 0 -1 0 0 0 0 0 150 50 10 0 20 0 1 0 5000 0 256 0",
     (40, 2.1, 50.0, 256 * 4096)),  # utime+stime+cutime+cstime
    (b"42 (sleep) S 1 42", None),
    (b"garbage", None),
])
def test_proc_stat_parsing_survives_odd_names_and_truncation(
        raw: bytes, expected: tuple[int, float, float, int] | None) -> None:
    stat = parse_stat(42, raw, clock_ticks=100, page_size=4096)
    got = None if stat is None else (stat.pgid, stat.cpu_s, stat.start_s, stat.rss_bytes)
    assert got == expected


@pytest.mark.parametrize(("environ", "expected"), [
    (b"A=1\0M27_TASK_ID=r/s\0M27_ATTEMPT=3\0M27_NODE_ID=n1\0M27_GPU_IDS=0,2\0",
     TaskEnv(task_id="r/s", attempt=3, node_id="n1", gpu_ids=(0, 2))),
    (b"M27_TASK_ID=r/s\0M27_ATTEMPT=3\0M27_NODE_ID=n1\0M27_GPU_IDS=\0",
     TaskEnv(task_id="r/s", attempt=3, node_id="n1")),
    (b"M27_TASK_ID=r/s\0M27_ATTEMPT=x\0M27_NODE_ID=n1\0", None),
    (b"M27_TASK_ID=r/s\0M27_ATTEMPT=1\0", None),
    (b"PATH=/bin\0", None),
    (b"", None),
])
def test_environ_parsing(environ: bytes, expected: TaskEnv | None) -> None:
    assert parse_environ(environ) == expected


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


def test_simulated_backend_measures_what_each_task_group_does(tmp_path: Path) -> None:
    """CPU use since the last sample drives utilization, resident memory is GPU memory, and
    a stray process of this node's task (here: of an ended one) holds memory too."""
    page = os.sysconf("SC_PAGE_SIZE")
    ticks = os.sysconf("SC_CLK_TCK")
    mb = 1024 * 1024 // page  # pages per MiB

    def procs(busy_ticks: int) -> dict[int, dict[str, Any]]:
        return {
            100: {"ticks": busy_ticks, "start": 990 * ticks, "rss": 300 * mb},
            101: {"pgid": 100, "rss": 100 * mb},
            200: {"start": 990 * ticks, "rss": 50 * mb},  # asleep: no CPU time
            300: {"rss": 64 * mb, "env": env_of("r/ended", 1, gpus="1")},
            400: {"rss": 64 * mb, "env": env_of("r/far", 1, node="n2", gpus="1")},
        }

    proc = fake_proc(tmp_path / "proc", procs(5 * ticks), uptime=1000.0)
    gpus = simulated_gpus("n1", GpuSpec(mode="sim", count=2, memory_mb=16384))
    sim = SimulatedGpus(gpus, "n1", proc)
    holdings = [Holding(gpu_ids=(0,), gpu_share=0.5, task_id="r/busy", attempt=1, pgid=100),
                Holding(gpu_ids=(0,), gpu_share=0.3, task_id="r/io", attempt=1, pgid=200)]
    first = sim.sample(holdings, now=0.0)
    assert first[0].utilization_pct == 25.0  # 5 s of CPU in its first 10 s, on half a GPU
    fake_proc(proc, procs(10 * ticks), uptime=1005.0)
    second = sim.sample(holdings, now=5.0)
    assert second[0].utilization_pct == 50.0  # a full CPU since: its whole share
    assert sim.task_utilization() == {("r/busy", 1): 100.0, ("r/io", 1): 0.0}
    assert [(p.pid, p.memory_mb, p.task_id) for p in second[0].processes] == [
        (100, 300, "r/busy"), (101, 100, "r/busy"), (200, 50, "r/io")]
    assert second[0].memory_used_mb == 450
    assert [(p.pid, p.task_id) for p in second[1].processes] == [(300, "r/ended")]
    assert second[1].utilization_pct == 0.0


def test_a_running_task_without_a_known_group_is_never_taken_for_a_stray(
        tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {
        100: {"env": env_of("r/measured", 1)},
        200: {"rss": 10, "env": env_of("r/booked", 1)},  # its group is not known yet
    })
    gpus = simulated_gpus("n1", GpuSpec(mode="sim", count=1, memory_mb=1000))
    sim = SimulatedGpus(gpus, "n1", proc)
    [sample] = sim.sample([
        Holding(gpu_ids=(0,), gpu_share=0.3, task_id="r/measured", attempt=1, pgid=100),
        Holding(gpu_ids=(0,), gpu_share=0.5, task_id="r/booked", attempt=1)], now=0.0)
    assert [(p.pid, p.task_id) for p in sample.processes] == [(100, "r/measured")]
    assert sample.memory_used_mb == 500  # the booked one's share, counted once
