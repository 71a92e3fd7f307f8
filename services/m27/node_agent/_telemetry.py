"""The node's telemetry loop, one `tick` per heartbeat: sample the GPUs, decide (`_monitor`)
and apply — publish idle / busy / over-share / leak events, stop tasks over their share,
kill leaked processes when that is safe — and hand the samples back to the agent. Between
heartbeats `watch_idle` samples every `[node] sample_interval` for idle and busy alone.

Every event has a `msg_id`, and events that could not be published wait in an outbox for
the next tick, so a NATS outage loses none and a re-publish is a no-op for JetStream.
The heartbeat's readings (`record`) go to M27_TELEMETRY for the history the same way, from
a second outbox that keeps the last `TELEMETRY_KEEP` of them (an hour of 5 s heartbeats),
so an outage never pushes out a task's events.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import stat
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec

from m27.common import events, subjects
from m27.common.logging import get_logger
from m27.common.model import GpuSample, TaskHolding, per_gpu_share
from m27.node_agent import metrics
from m27.node_agent._backends import PROC, Backend, TaskKey, read_environ
from m27.node_agent._gpus import Holding
from m27.node_agent._monitor import (
    EnergyMeter,
    IdleDecision,
    IdleDetector,
    LeakDecision,
    LeakWatch,
    OverShareDecision,
    OverSharePolicy,
    OverShareWatch,
    Phase,
    TaskSample,
    leak_candidates,
    memory_limit_mb,
)

log = get_logger()

OUTBOX_MAX: Final = 1000
#: Heartbeat readings kept for the telemetry stream while it cannot be reached.
TELEMETRY_KEEP: Final = 720
#: Ended tasks are remembered this long: their processes' GPU memory is a leak to clean.
ENDED_KEEP_S: Final = 3600.0
PHASE_MAX_BYTES: Final = 64

Publish = Callable[[str, events.Message, str], Awaitable[object]]
StopTaskFn = Callable[[str, int, str], Awaitable[object] | object]


class RunningView(msgspec.Struct, frozen=True, kw_only=True):
    """What telemetry needs of one running task (the runner builds these)."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0
    gpu_memory_mb: int = 0  # its `gpu_memory` request (all of its GPUs together); 0: none
    pgid: int = 0  # its process group (the main pid)
    paused: bool = False
    phase_file: str = ""  # $M27_PHASE_FILE: the training library writes `io` or `compute`

    @property
    def key(self) -> TaskKey:
        return (self.task_id, self.attempt)


class TelemetrySettings(msgspec.Struct, frozen=True, kw_only=True):
    idle_threshold_pct: float = 10.0
    idle_samples: int = 3
    over_share: OverSharePolicy = "stop"
    over_share_samples: int = 3
    memory_overprovision: float = 1.0


def read_phase(path: str) -> Phase:
    """The phase a task reported: `io`, `compute`, or "" (none, unreadable, anything else).

    Opened non-blocking and read only if it is a regular file: a task could make it a FIFO.
    """
    if not path:
        return ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return ""
    try:
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return ""
            word = file.read(PHASE_MAX_BYTES).strip().lower()
    except OSError:
        return ""
    return "io" if word == b"io" else "compute" if word == b"compute" else ""


def kill_leaked(pids: Sequence[int], key: TaskKey, node_id: str, proc: Path = PROC) -> int:
    """SIGKILL each pid whose environment still says it is of `key` on this node (checked
    just before, as pids are reused); how many were killed."""
    killed = 0
    for pid in pids:
        env = read_environ(pid, proc)
        if pid <= 1 or pid == os.getpid() or env is None or \
                (env.task_id, env.attempt, env.node_id) != (*key, node_id):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            continue
    return killed


def _holding(view: RunningView) -> Holding:
    return Holding(gpu_ids=view.gpu_ids, gpu_share=view.gpu_share, task_id=view.task_id,
                   attempt=view.attempt, pgid=view.pgid)


def task_samples(views: Sequence[RunningView], samples: Sequence[GpuSample],
                 phases: Mapping[TaskKey, Phase], task_utilization: Mapping[TaskKey, float],
                 unmeasured: Mapping[int, frozenset[str]], gpu_total_mb: Mapping[int, int],
                 overprovision: float) -> list[TaskSample]:
    """Each running task as this sample saw it (pure)."""
    by_index = {s.index: s for s in samples}
    memory: dict[TaskKey, dict[int, int]] = {}
    for sample in samples:
        for proc in sample.processes:
            held = memory.setdefault((proc.task_id, proc.attempt), {})
            held[sample.index] = held.get(sample.index, 0) + proc.memory_mb
    found = []
    for view in views:
        share = per_gpu_share(view.gpu_ids, view.gpu_share)
        util = task_utilization.get(view.key)
        if util is None:  # the GPUs' own utilization (shared GPUs: all of their tenants)
            known = [by_index[g].utilization_pct for g in view.gpu_ids if g in by_index
                     and "utilization" not in unmeasured.get(g, frozenset())]
            util = sum(known) / len(known) if known else None
        limits = {g: memory_limit_mb(
            (by_index[g].memory_total_mb if g in by_index else 0) or gpu_total_mb.get(g, 0),
            share, view.gpu_memory_mb, len(view.gpu_ids), overprovision)
            for g in view.gpu_ids}
        found.append(TaskSample(key=view.key, gpu_ids=view.gpu_ids, share=share,
                                utilization_pct=util, phase=phases.get(view.key, ""),
                                paused=view.paused, memory_mb=memory.get(view.key, {}),
                                limit_mb=limits))
    return found


class Telemetry:
    """Ties the backend, the watchers and the bus together for the agent."""

    def __init__(self, backend: Backend, node_id: str, settings: TelemetrySettings,
                 publish: Publish, stop_task: StopTaskFn, *, hostname: str = "",
                 proc: Path = PROC) -> None:
        self._backend = backend
        self._node_id = node_id
        self._settings = settings
        self._publish = publish
        self._stop_task = stop_task
        self._hostname = hostname
        self._proc = proc
        self._idle = IdleDetector(settings.idle_threshold_pct, settings.idle_samples)
        self._over = OverShareWatch(settings.over_share, settings.over_share_samples)
        self._energy = EnergyMeter()
        self._leaks = LeakWatch(node_id, never={os.getpid()})
        self._ended: dict[TaskKey, float] = {}
        self._outbox: deque[tuple[str, events.Event, str]] = deque()
        self._readings: deque[events.GpuTelemetry] = deque(maxlen=TELEMETRY_KEEP)
        self.readings_dropped = 0
        self._now = 0.0
        self.samples: tuple[GpuSample, ...] = ()
        self._views: tuple[RunningView, ...] = ()
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------ the agent's calls

    async def tick(self, running: Sequence[RunningView], now: float) -> tuple[GpuSample, ...]:
        """The heartbeat's sample of every GPU, every decision applied (idle, over-share,
        leaks, energy); () if the GPUs could not be read."""
        return await self._observe(running, now, full=True)

    async def watch_idle(self, running: Sequence[RunningView], now: float) -> None:
        """A sample between heartbeats (`[node] sample_interval`): only idle and busy are
        decided (and energy counted), so a stall is lent out seconds after it starts rather
        than heartbeats later. Over-share and leak checks keep the heartbeat's pace."""
        await self._observe(running, now, full=False)

    async def _observe(self, running: Sequence[RunningView], now: float, *,
                       full: bool) -> tuple[GpuSample, ...]:
        async with self._lock:  # one reading at a time: the backends keep deltas
            self._now = max(self._now, now)
            views = tuple(running)
            try:
                samples, phases = await asyncio.to_thread(self._read, views, now)
            except Exception as exc:  # NVML can fail (GPU lost); the node is still alive
                if full:  # logged once per heartbeat, not once per sample
                    self.samples = ()
                    log.error("node.gpu_sample_failed", backend=self._backend.kind,
                              error=str(exc) or type(exc).__name__)
                await self._flush()
                return ()
            tasks = task_samples(views, samples, phases, self._backend.task_utilization(),
                                 self._backend.unmeasured(),
                                 {g.index: g.memory_total_mb for g in self._backend.gpus},
                                 self._settings.memory_overprovision)
            self._energy.add(samples, tasks, now)
            by_key = {v.key: v for v in views}
            for task in tasks:
                idle = self._idle.observe(task)
                if idle is not None:
                    self._on_idle(by_key[task.key], idle, now)
            self.samples, self._views = samples, views  # the heartbeat carries the latest
            if full:
                for task in tasks:
                    for over in self._over.observe(task):
                        await self._on_over_share(by_key[task.key], over, now)
                await self._check_leaks(samples, set(by_key), now)
            await self._flush()
            return samples

    def record(self, at: float, incarnation: str, seq: int, samples: Sequence[GpuSample],
               holdings: Sequence[TaskHolding]) -> None:
        """Queue a heartbeat's readings for the telemetry stream (sent at the next sample,
        not on the lease renewal's path); the oldest go when `TELEMETRY_KEEP` wait."""
        if len(self._readings) == self._readings.maxlen:
            self.readings_dropped += 1
            if self.readings_dropped % 100 == 1:
                log.error("telemetry.readings_dropped", dropped=self.readings_dropped,
                          why="the telemetry stream has not taken any for a while")
        self._readings.append(events.GpuTelemetry(
            at=at, node_id=self._node_id, incarnation=incarnation, seq=seq,
            backend=self._backend.kind, gpus=tuple(samples), tasks=tuple(holdings)))

    def energy_j(self, task_id: str, attempt: int) -> float | None:
        """The task's share of its GPUs' energy so far (for its TaskExited)."""
        return self._energy.energy_j((task_id, attempt))

    def forget(self, task_id: str, attempt: int) -> None:
        """After its exit: its state goes, and what its processes still hold is a leak."""
        key = (task_id, attempt)
        self._idle.forget(key)
        self._over.forget(key)
        self._energy.forget(key)
        self._ended[key] = self._now
        self._ended = {k: t for k, t in self._ended.items() if t >= self._now - ENDED_KEEP_S}

    def metrics_text(self) -> str:
        """The Prometheus exposition of the latest sample (for `MetricsServer`)."""
        holdings = [TaskHolding(task_id=v.task_id, attempt=v.attempt, gpu_ids=v.gpu_ids,
                                gpu_share=v.gpu_share, paused=v.paused) for v in self._views]
        running = {v.key for v in self._views}
        energy = {k: j for k, j in self._energy.totals().items() if k in running}
        return metrics.render(self._node_id, self._hostname, self._backend.kind,
                               self._backend.gpus, self.samples, holdings, energy,
                               self._backend.unmeasured())

    # ------------------------------------------------------------ reading (in a thread)

    def _read(self, views: Sequence[RunningView],
              now: float) -> tuple[tuple[GpuSample, ...], dict[TaskKey, Phase]]:
        samples = self._backend.sample([_holding(v) for v in views], now)
        phases = {v.key: read_phase(v.phase_file) for v in views if v.phase_file}
        return samples, phases

    # ------------------------------------------------------------ applying decisions

    def _queue(self, subject: str, event: events.Event, msg_id: str) -> None:
        if len(self._outbox) >= OUTBOX_MAX:
            dropped = self._outbox.popleft()
            log.error("telemetry.event_dropped", msg_id=dropped[2], why="outbox full")
        self._outbox.append((subject, event, msg_id))

    async def _flush(self) -> None:
        while self._outbox:
            subject, event, msg_id = self._outbox[0]
            try:
                await self._publish(subject, event, msg_id)
            except Exception as exc:  # the bus is down: try again next tick, in order
                log.warning("telemetry.publish_failed", msg_id=msg_id, waiting=len(self._outbox),
                            error=str(exc) or type(exc).__name__)
                return
            self._outbox.popleft()
        subject = subjects.telemetry(subjects.node_sender(self._node_id))
        while self._readings:
            reading = self._readings[0]
            msg_id = f"{self._node_id}:{reading.incarnation}:{reading.seq}:telemetry"
            try:
                await self._publish(subject, reading, msg_id)
            except Exception as exc:  # kept for the next sample
                log.warning("telemetry.publish_failed", msg_id=msg_id,
                            waiting=len(self._readings), error=str(exc) or type(exc).__name__)
                return
            self._readings.popleft()

    def _on_idle(self, view: RunningView, decision: IdleDecision, now: float) -> None:
        subject = subjects.task_events(view.run_id, view.step,
                                       subjects.node_sender(self._node_id))
        event: events.Event
        if decision.idle:
            event = events.TaskIdle(
                at=now, task_id=view.task_id, run_id=view.run_id, step=view.step,
                attempt=view.attempt, node_id=self._node_id, gpu_ids=view.gpu_ids,
                idle_share=decision.idle_share, utilization_pct=decision.utilization_pct,
                reason=decision.reason)
        else:
            event = events.TaskBusy(
                at=now, task_id=view.task_id, run_id=view.run_id, step=view.step,
                attempt=view.attempt, node_id=self._node_id,
                utilization_pct=decision.utilization_pct)
        what = "idle" if decision.idle else "busy"
        log.info(f"task.{what}", task_id=view.task_id, attempt=view.attempt,
                 reason=decision.reason, utilization_pct=decision.utilization_pct)
        self._queue(subject, event, f"{view.task_id}:{view.attempt}:{what}:{now:.3f}")

    async def _on_over_share(self, view: RunningView, decision: OverShareDecision,
                             now: float) -> None:
        event = events.TaskOverShare(
            at=now, task_id=view.task_id, run_id=view.run_id, step=view.step,
            attempt=view.attempt, node_id=self._node_id, gpu_index=decision.gpu_index,
            used_mb=decision.used_mb, limit_mb=decision.limit_mb, action=decision.action)
        stamp = "" if decision.action == "stopped" else f":{now:.3f}"
        log.warning("task.over_share", task_id=view.task_id, attempt=view.attempt,
                    action=decision.action, reason=decision.reason)
        self._queue(subjects.task_events(view.run_id, view.step,
                                       subjects.node_sender(self._node_id)), event,
                    f"{view.task_id}:{view.attempt}:over_share:{decision.action}{stamp}")
        if decision.action == "stopped":
            try:
                result = self._stop_task(view.task_id, view.attempt, decision.reason)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # the runner's problem must not end the sampling
                log.exception("task.over_share_stop_failed", task_id=view.task_id,
                              attempt=view.attempt, error=str(exc) or type(exc).__name__)

    async def _check_leaks(self, samples: Sequence[GpuSample], running: set[TaskKey],
                           now: float) -> None:
        candidates = leak_candidates(samples, running)
        pids = {p for held in candidates.values() for p in held}
        env_node = await asyncio.to_thread(self._env_nodes, pids) if pids else {}
        for leak in self._leaks.observe(candidates, self._ended, env_node):
            await self._on_leak(leak, now)

    def _env_nodes(self, pids: set[int]) -> dict[int, str | None]:
        found: dict[int, str | None] = {}
        for pid in pids:
            env = read_environ(pid, self._proc)
            found[pid] = None if env is None else env.node_id
        return found

    async def _on_leak(self, leak: LeakDecision, now: float) -> None:
        killed = 0
        if leak.cleaned:  # re-checked pid by pid just before the kill: pids are reused
            killed = await asyncio.to_thread(kill_leaked, leak.pids, leak.key, self._node_id,
                                             self._proc)
        log.warning("gpu.memory_leak", gpu_index=leak.gpu_index, task_id=leak.key[0],
                    attempt=leak.key[1], pids=list(leak.pids), memory_mb=leak.memory_mb,
                    cleaned=leak.cleaned, killed=killed, reason=leak.reason)
        event = events.GpuMemoryLeak(at=now, node_id=self._node_id, gpu_index=leak.gpu_index,
                                     task_id=leak.key[0], pids=leak.pids,
                                     memory_mb=leak.memory_mb, cleaned=killed > 0)
        pid_text = "-".join(map(str, leak.pids))
        self._queue(subjects.node_events(self._node_id), event,
                    f"{self._node_id}:leak:{leak.gpu_index}:{leak.key[0]}:{leak.key[1]}:"
                    f"{pid_text}")
