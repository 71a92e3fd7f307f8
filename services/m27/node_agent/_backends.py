"""The node's GPU backend: real GPUs through NVML, simulated GPUs, or none.

A backend knows its GPUs and takes one reading of each per heartbeat, with the processes
holding GPU memory mapped to the tasks that own them. Which one a node gets is decided
once, at start, from the `--gpus` spec (`open_backend`).

The `/proc` readers here are the thin shell under the pure model in `_gpus`: one pass over
`/proc/<pid>/stat` per sample gives every process's group, CPU time and resident memory;
`/proc/<pid>/environ` (read once per process, cached) says which task started it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import msgspec
import pynvml

from m27.common.model import GpuBackend, GpuInfo, GpuSample, per_gpu_share
from m27.common.platform import Platform
from m27.node_agent import _nvml
from m27.node_agent._gpus import (
    GpuSpec,
    Holding,
    TaskActivity,
    booked_activities,
    busy_fraction,
    simulated_gpus,
    simulated_samples,
    task_utilization_pct,
)

TaskKey = tuple[str, int]
PROC: Final = Path("/proc")
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE")


class Backend(Protocol):
    """What the agent needs from a GPU backend."""

    @property
    def kind(self) -> GpuBackend: ...

    @property
    def gpus(self) -> tuple[GpuInfo, ...]: ...

    @property
    def platform(self) -> Platform:
        """Driver, CUDA and NVML versions ("" where not known)."""
        ...

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]: ...

    def task_utilization(self) -> Mapping[TaskKey, float]:
        """Per task, the % of its own share it kept busy at the last sample, where the
        backend can tell (simulated: always; NVML: never — use its GPUs' utilization)."""
        ...

    def unmeasured(self) -> Mapping[int, frozenset[str]]:
        """Per GPU, the readings of the last sample the hardware did not give (0 there)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- /proc


@dataclass(frozen=True, slots=True)
class ProcStat:
    """One process, from /proc/<pid>/stat. `cpu_s` includes its reaped children's time, so a
    group's total does not drop when a short-lived child exits."""

    pid: int
    pgid: int
    state: str
    cpu_s: float
    start_s: float  # since boot
    rss_bytes: int


class TaskEnv(msgspec.Struct, frozen=True, kw_only=True):
    """The M27_* variables a process was started with: which task (attempt, node) it is of."""

    task_id: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...] = ()


def parse_stat(pid: int, raw: bytes, clock_ticks: int = _CLOCK_TICKS,
               page_size: int = _PAGE_SIZE) -> ProcStat | None:
    """`/proc/<pid>/stat` (the name in parentheses may hold spaces and parentheses)."""
    try:
        fields = raw.rsplit(b")", 1)[1].split()
        ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        return ProcStat(pid=pid, pgid=int(fields[2]), state=fields[0].decode(),
                        cpu_s=ticks / clock_ticks, start_s=int(fields[19]) / clock_ticks,
                        rss_bytes=max(0, int(fields[21])) * page_size)
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def parse_environ(raw: bytes) -> TaskEnv | None:
    """The task a process belongs to, from its NUL-separated environment; None if none."""
    found: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if item.startswith(b"M27_"):
            name, _, value = item.partition(b"=")
            found[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    task_id, node_id = found.get("M27_TASK_ID", ""), found.get("M27_NODE_ID", "")
    try:
        attempt = int(found.get("M27_ATTEMPT", ""))
        gpu_ids = tuple(int(i) for i in found.get("M27_GPU_IDS", "").split(",") if i.strip())
    except ValueError:
        return None
    if not task_id or not node_id:
        return None
    return TaskEnv(task_id=task_id, attempt=attempt, node_id=node_id, gpu_ids=gpu_ids)


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None


def read_environ(pid: int, proc: Path = PROC) -> TaskEnv | None:
    raw = _read(proc / str(pid) / "environ")
    return None if raw is None else parse_environ(raw)


class ProcTable:
    """Every process on the machine at one moment (one read of each /proc/<pid>/stat)."""

    def __init__(self, stats: Mapping[int, ProcStat], uptime_s: float) -> None:
        self.stats = dict(stats)
        self.uptime_s = uptime_s
        self._groups: dict[int, list[ProcStat]] = {}
        for stat in self.stats.values():
            self._groups.setdefault(stat.pgid, []).append(stat)

    @classmethod
    def read(cls, proc: Path = PROC) -> ProcTable:
        stats: dict[int, ProcStat] = {}
        try:
            names = os.listdir(proc)
        except OSError:
            names = []
        for name in names:
            if name.isdigit():
                raw = _read(proc / name / "stat")
                stat = None if raw is None else parse_stat(int(name), raw)
                if stat is not None:
                    stats[stat.pid] = stat
        uptime = _read(proc / "uptime") or b"0"
        return cls(stats, float(uptime.split()[0]))

    def group(self, pgid: int) -> list[ProcStat]:
        """The processes of one process group (a task's: its pgid is its main pid)."""
        return self._groups.get(pgid, []) if pgid > 0 else []


class EnvCache:
    """Each process's M27_* variables, read once: (pid, start time) names one process for
    good, and the variables it was started with do not change."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._known: dict[tuple[int, float], TaskEnv | None] = {}

    def get(self, stat: ProcStat) -> TaskEnv | None:
        key = (stat.pid, stat.start_s)
        if key not in self._known:
            self._known[key] = read_environ(stat.pid, self._proc)
        return self._known[key]

    def prune(self, table: ProcTable) -> None:
        """Forget processes that are gone."""
        self._known = {k: v for k, v in self._known.items()
                       if (s := table.stats.get(k[0])) is not None and s.start_s == k[1]}


def _never_ours(pid: int) -> bool:
    return pid <= 1 or pid == os.getpid()


def owners(table: ProcTable, holdings: Sequence[Holding], envs: EnvCache,
           node_id: str, pids: Iterable[int] | None = None) -> dict[int, TaskKey]:
    """Which task each process belongs to: a running task's process group, or — for one
    that left its group, or outlived its task — the task its environment names on this node.
    `pids`: only these (default: every process in the table). Unknown ones are left out."""
    by_group = {h.pgid: (h.task_id, h.attempt) for h in holdings if h.pgid > 0 and h.task_id}
    wanted = table.stats.keys() if pids is None else pids
    found: dict[int, TaskKey] = {}
    for pid in wanted:
        stat = table.stats.get(pid)
        if stat is None or _never_ours(pid):
            continue
        if stat.pgid in by_group:
            found[pid] = by_group[stat.pgid]
            continue
        env = envs.get(stat) if node_id else None
        if env is not None and env.node_id == node_id:
            found[pid] = (env.task_id, env.attempt)
    return found


def map_processes(sample: GpuSample, owner_of: Mapping[int, TaskKey]) -> GpuSample:
    """A reading with each process's task filled in where it is known."""
    processes = tuple(
        msgspec.structs.replace(p, task_id=owner_of[p.pid][0], attempt=owner_of[p.pid][1])
        if p.pid in owner_of else p
        for p in sample.processes)
    return msgspec.structs.replace(sample, processes=processes)


# ---------------------------------------------------------------- backends


class NoGpus:
    """A CPU-only node."""

    kind: GpuBackend = "none"
    gpus: tuple[GpuInfo, ...] = ()
    platform: Platform = Platform()

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        return ()

    def task_utilization(self) -> Mapping[TaskKey, float]:
        return {}

    def unmeasured(self) -> Mapping[int, frozenset[str]]:
        return {}

    def close(self) -> None:
        return None


class SimulatedGpus:
    """GPUs that exist only in m27's model, driven by what the tasks' processes really do:
    their CPU use is the GPU load, their resident memory the GPU memory (see `_gpus`).

    A holding without a process group (`pgid` 0) is modelled from its booking instead.
    Processes of this node's tasks that left their group or outlived their task are found
    by their environment and hold (simulated) memory too — which is what a leak looks like.
    """

    kind: GpuBackend = "simulated"

    def __init__(self, gpus: tuple[GpuInfo, ...], node_id: str = "",
                 proc: Path = PROC, platform: Platform | None = None) -> None:
        self.gpus = gpus
        self.platform = platform or Platform()
        self._node_id = node_id
        self._proc = proc
        self._envs = EnvCache(proc)
        self._last: dict[int, GpuSample] = {}
        self._last_at: float | None = None
        self._cpu: dict[TaskKey, float] = {}
        self._utilization: dict[TaskKey, float] = {}

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        dt = 0.0 if self._last_at is None else now - self._last_at
        measured = [h for h in holdings if h.pgid > 0 and h.gpu_ids]
        booked = [h for h in holdings if h.pgid <= 0]
        activities = booked_activities(booked)
        if measured or not booked:  # without process groups, strays cannot be told apart
            table = ProcTable.read(self._proc)
            booked_keys = {(h.task_id, h.attempt) for h in booked if h.task_id}
            activities += self._activities(table, measured, booked_keys, dt)
            self._envs.prune(table)
        samples = simulated_samples(self.gpus, activities, self._last, dt)
        self._last = {s.index: s for s in samples}
        self._last_at = now
        return samples

    def _activities(self, table: ProcTable, measured: Sequence[Holding],
                    booked: set[TaskKey], dt: float) -> list[TaskActivity]:
        owner_of = owners(table, measured, self._envs, self._node_id)
        by_task: dict[TaskKey, list[ProcStat]] = {}
        for pid, key in owner_of.items():
            by_task.setdefault(key, []).append(table.stats[pid])
        running = {(h.task_id, h.attempt): h for h in measured}
        cpu: dict[TaskKey, float] = {}
        activities: list[TaskActivity] = []
        for key, holding in running.items():
            members = by_task.pop(key, [])
            main = table.stats.get(holding.pgid)
            age = table.uptime_s - main.start_s if main is not None else 0.0
            cpu[key] = sum(s.cpu_s for s in members)
            busy = busy_fraction(cpu[key], self._cpu.get(key), dt, age)
            activities.append(_activity(key, holding.gpu_ids,
                                        per_gpu_share(holding.gpu_ids, holding.gpu_share),
                                        busy, members))
        self._cpu = cpu
        self._utilization = {(a.task_id, a.attempt): task_utilization_pct(a)
                             for a in activities}
        for key, members in by_task.items():  # strays: their task is not running here
            env = None if key in booked else self._envs.get(members[0])
            if env is not None and env.gpu_ids:
                activities.append(_activity(key, env.gpu_ids, 0.0, 0.0, members))
        return activities

    def task_utilization(self) -> Mapping[TaskKey, float]:
        return dict(self._utilization)

    def unmeasured(self) -> Mapping[int, frozenset[str]]:
        return {}

    def close(self) -> None:
        return None


def _activity(key: TaskKey, gpu_ids: tuple[int, ...], share: float, busy: float,
              members: Sequence[ProcStat]) -> TaskActivity:
    return TaskActivity(task_id=key[0], attempt=key[1], gpu_ids=gpu_ids, share=share,
                        busy=busy, rss=tuple((s.pid, s.rss_bytes) for s in members
                                             if s.state != "Z"))


class NvmlGpus:
    """Real NVIDIA GPUs, read through NVML (what `nvidia-smi` shows).

    NVML's pids are mapped to tasks through /proc; in a container that does not share the
    host's pid namespace they match nothing here and stay unowned.
    """

    kind: GpuBackend = "nvml"

    def __init__(self, lib: _nvml.NvmlLib, handles: list[_nvml.NvmlHandle],
                 node_id: str = "", proc: Path = PROC) -> None:
        self._lib = lib
        self._handles = handles
        self._node_id = node_id
        self._proc = proc
        self._envs = EnvCache(proc)
        self._unmeasured: dict[int, frozenset[str]] = {}
        self.gpus = tuple(_nvml.read_info(lib, h, i) for i, h in enumerate(handles))
        self.platform = _nvml.read_platform(lib)

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        readings = [_nvml.read_reading(self._lib, h, i) for i, h in enumerate(self._handles)]
        self._unmeasured = {r.index: r.missing for r in readings if r.missing}
        samples = [_nvml.gpu_sample_from_reading(r) for r in readings]
        pids = {p.pid for s in samples for p in s.processes}
        if not pids:
            return tuple(samples)
        table = ProcTable.read(self._proc)
        owner_of = owners(table, holdings, self._envs, self._node_id, pids)
        self._envs.prune(table)
        return tuple(map_processes(s, owner_of) for s in samples)

    def task_utilization(self) -> Mapping[TaskKey, float]:
        return {}

    def unmeasured(self) -> Mapping[int, frozenset[str]]:
        return dict(self._unmeasured)

    def close(self) -> None:
        _nvml.shutdown(self._lib)


def open_backend(spec: GpuSpec, node_id: str,
                 lib: _nvml.NvmlLib = pynvml) -> tuple[Backend, str]:
    """The backend `spec` asks for, and a sentence saying what was chosen and why."""
    if spec.mode == "none":
        return NoGpus(), "no GPUs (--gpus none)"
    if spec.mode == "sim":
        gpus = simulated_gpus(node_id, spec)
        claimed = ", ".join(f"{k} {v}" for k, v in (("model", spec.model),
                                                     ("driver", spec.platform.driver),
                                                     ("CUDA", spec.platform.cuda)) if v)
        return SimulatedGpus(gpus, node_id, platform=spec.platform), (
            f"SIMULATED GPUs: {spec.count} x {spec.memory_mb} MiB, not real hardware "
            f"(--gpus sim:{spec.count})" + (f"; claims {claimed}" if claimed else ""))
    handles, why = _nvml.probe(lib)
    if not handles:
        return NoGpus(), (f"no GPUs: {why}; running CPU tasks only "
                          "(--gpus sim:N simulates N GPUs)")
    try:
        backend = NvmlGpus(lib, handles, node_id)
    except _nvml.NVML_ERRORS as exc:
        _nvml.shutdown(lib)
        return NoGpus(), (f"no GPUs: NVML could not read them ({exc}); running CPU tasks "
                          "only (--gpus sim:N simulates N GPUs)")
    names = ", ".join(sorted({g.name for g in backend.gpus}))
    versions = backend.platform
    return backend, (f"{len(handles)} NVIDIA GPU(s) through NVML: {names}; driver "
                     f"{versions.driver or 'unknown'}, CUDA {versions.cuda or 'unknown'}")
