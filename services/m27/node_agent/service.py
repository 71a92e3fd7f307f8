"""The node-agent service: register the node, heartbeat, take commands, shut down cleanly.

Order of work: NATS and gRPC up → GPU backend chosen → leftovers of an earlier agent reaped
→ NodeInfo stored and NodeRegistered published → heartbeats and the command consumer run →
ready. On SIGTERM: NodeInfo marked "stopping" and NodeStopping published (nothing more is
placed here), no new commands, every task stopped (SIGTERM, its grace period to checkpoint,
SIGKILL) and its exit reported, NodeInfo marked "stopped" and NodeStopped published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Literal

import msgspec
import nats.errors
from nats.aio.msg import Msg

from m27 import __version__
from m27.common import events, subjects
from m27.common.api_auth import step_env
from m27.common.bus import NatsBus, consume, decode_or_poison
from m27.common.config import NodeSection
from m27.common.logging import bind_contextvars, get_logger
from m27.common.metrics import MetricsServer
from m27.common.model import NodeInfo
from m27.common.service import ServiceRuntime
from m27.node_agent._backends import Backend, open_backend
from m27.node_agent._file_sync import FileCheckpoints, remote_stores
from m27.node_agent._isolation import detect_cgroups, mps_running
from m27.node_agent._lease import Lease, lease_path, monotonic, start_guard, stop_guard
from m27.node_agent._maintenance import run_command
from m27.node_agent._runner import TaskRunner
from m27.node_agent._staging import stage_inputs
from m27.node_agent._tasks import NodeContext, passed_env
from m27.node_agent._telemetry import Telemetry, TelemetrySettings
from m27.node_agent.api import SERVICE_NAME as NODE_SERVICE
from m27.node_agent.api import NodeServicer, nothing_running, running_check
from m27.node_agent.flags import check_settings, cpu_slots, gpu_spec, resolve_node_id

log = get_logger()

STOPPED_REASON: Final = "node agent stopped"
#: After the tasks' grace: how long shutdown waits for their exits to reach the bus.
REPORT_TIMEOUT_S: Final = 15.0
CONSUMER_STOP_TIMEOUT_S: Final = 15.0
FENCE_CHECK_S: Final = 0.25
#: A renewal that failed (NATS busy electing a leader, a reconnect) is tried again after
#: this, not after a whole heartbeat interval: the lease lapses fence_after after the last
#: acknowledged one, and two lost intervals would already fence the node's tasks.
RENEW_RETRY_S: Final = 0.5


class NodeAgent:
    """One node: its registration, heartbeats, command consumer and tasks."""

    def __init__(self, bus: NatsBus, *, node_id: str, backend: Backend, settings: NodeSection,
                 stop: asyncio.Event, home: Path, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time,
                 overprovision: float = 1.0,
                 files: FileCheckpoints | None = None,
                 api_env: Callable[[str, int], Mapping[str, str]] | None = None) -> None:
        self._bus = bus
        self._node_id = node_id
        self._backend = backend
        self._settings = settings
        self._stop = stop
        self._clock = clock
        self.incarnation = secrets.token_hex(6)
        self._state: Literal["up", "stopping"] = "up"
        self.lease = Lease(node_id=node_id, fence_after_s=settings.lease_fence_after,
                           path=lease_path(home, node_id))
        env = os.environ if environ is None else environ
        self.cgroups = detect_cgroups(node_id)
        self.mps = mps_running(env)
        context = NodeContext(node_id=node_id, backend=backend.kind, gpus=backend.gpus,
                              home=home, python=sys.executable, mps=self.mps,
                              api_env=api_env)
        self.telemetry = Telemetry(
            backend, node_id, TelemetrySettings(
                idle_threshold_pct=settings.idle_threshold_pct,
                idle_samples=settings.idle_samples, over_share=settings.over_share,
                over_share_samples=settings.over_share_samples,
                memory_overprovision=overprovision),
            self._publish, self._stop_over_share, hostname=socket.gethostname())
        self.runner = TaskRunner(bus, context, stop_grace_s=settings.stop_grace,
                                 environ=passed_env(env, settings.pass_env), clock=clock,
                                 leased=self._leased,
                                 cgroups=self.cgroups, energy=self._task_energy,
                                 files=files)
        self.metrics: MetricsServer | None = None
        self.metrics_address = ""
        self._info: NodeInfo | None = None
        self._heartbeats_stop = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._fence_task: asyncio.Task[None] | None = None
        self._stale_task: asyncio.Task[None] | None = None
        self._sample_task: asyncio.Task[None] | None = None
        self._first_sample = asyncio.Event()
        self._consumer_task: asyncio.Task[None] | None = None
        self._staging: set[asyncio.Task[None]] = set()
        self._guard: subprocess.Popen[bytes] | None = None
        self.fenced = False

    async def _publish(self, subject: str, event: events.Message, msg_id: str) -> None:
        await self._bus.publish(subject, event, msg_id=msg_id)

    def _stop_over_share(self, task_id: str, attempt: int, note: str) -> None:
        self.runner.stop_over_share(task_id, attempt, note)

    def _task_energy(self, task_id: str, attempt: int) -> float | None:
        energy = self.telemetry.energy_j(task_id, attempt)
        self.telemetry.forget(task_id, attempt)
        return energy

    async def _start_metrics(self) -> str:
        """Prometheus /metrics with DCGM-exporter names, if `[node] metrics_bind` is set."""
        if not self._settings.metrics_bind:
            return ""
        self.metrics = MetricsServer(self._settings.metrics_bind,
                                     self.telemetry.metrics_text)
        address = await self.metrics.start()
        log.info("node.metrics", address=f"http://{address}/metrics")
        return address

    def _leased(self) -> bool:
        """May tasks run? Only while the lease holds (it lapses fence_after after the last
        acknowledged renewal)."""
        return self.lease.renewed_at is not None and not self.lease.expired(monotonic())

    async def start(self) -> None:
        await self.runner.recover()
        self.metrics_address = await self._start_metrics()
        await self._register()
        self._guard = start_guard(self.lease.path, self.runner.ledger_path, self._node_id)
        self._sample_task = asyncio.create_task(self._sample_loop(), name="telemetry")
        with contextlib.suppress(TimeoutError):  # so the first heartbeat carries a reading
            await asyncio.wait_for(self._first_sample.wait(), self._settings.heartbeat_interval)
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")
        self._fence_task = asyncio.create_task(self._fence_loop(), name="self-fencing")
        self._stale_task = asyncio.create_task(self._stale_loop(), name="stale attempts")
        self._consumer_task = asyncio.create_task(self._consume(), name="node commands")

    async def _register(self) -> None:
        now = self._clock()
        info = NodeInfo(node_id=self._node_id, hostname=socket.gethostname(),
                        backend=self._backend.kind, gpus=self._backend.gpus,
                        cpu_slots=cpu_slots(self._settings), registered_at=now,
                        last_heartbeat=now, pid=os.getpid(), version=__version__,
                        incarnation=self.incarnation, seq=1,
                        cgroups=self.cgroups.enabled, mps=self.mps,
                        metrics_address=self.metrics_address,
                        platform=self._backend.platform)
        await self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, info)
        self.lease.renewed(monotonic())
        self._info = info
        await self._bus.publish(subjects.node_events(self._node_id), events.NodeRegistered(
            at=now, node_id=self._node_id, hostname=info.hostname, backend=info.backend,
            gpus=info.gpus, cpu_slots=info.cpu_slots, platform=info.platform))
        log.log(logging.INFO if self.cgroups.enabled else logging.WARNING, "node.isolation",
                cpu_memory_limits="enforced" if self.cgroups.enabled else "NOT enforced",
                detail=self.cgroups.reason,
                gpu_shares="enforced by CUDA MPS" if self.mps else
                "NOT enforced on the GPU (no MPS); memory limits go to torch programs and "
                "per-process memory is watched")
        log.info("node.registered", backend=info.backend, gpus=len(info.gpus),
                 simulated=info.backend == "simulated", cpu_slots=info.cpu_slots,
                 incarnation=self.incarnation,
                 lease=f"fence after {self.lease.fence_after_s:g}s without renewal")

    # ------------------------------------------------------------ lease and heartbeats

    async def _heartbeat_loop(self) -> None:
        interval = self._settings.heartbeat_interval
        while not self._heartbeats_stop.is_set():
            pause = interval
            try:
                await self._renew()
            except Exception as exc:  # a missed renewal must not end the loop
                log.warning("node.lease_renewal_failed", error=str(exc) or type(exc).__name__)
                pause = min(RENEW_RETRY_S, interval)
            self._keep_guard()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeats_stop.wait(), pause)

    def _keep_guard(self) -> None:
        """Start the guard again if it died (found by the chaos suite: a killed guard left
        the node to its agent alone, unnoticed); a guard that starts reads the same lease
        and ledger files, so nothing is lost but the seconds it was away."""
        guard = self._guard
        if guard is None or guard.poll() is None or self._heartbeats_stop.is_set():
            return
        log.error("node.guard_died", pid=guard.pid, exit_code=guard.returncode,
                  action="started again")
        self._guard = start_guard(self.lease.path, self.runner.ledger_path, self._node_id)

    async def _announce_stopping(self, reason: str) -> None:
        """Before the tasks are stopped: so the scheduler places nothing more here (the
        retries of these very tasks included) while they checkpoint and exit."""
        if self._info is None:
            return
        self._state = "stopping"
        try:
            self._info = msgspec.structs.replace(self._info, state="stopping")
            await asyncio.wait_for(
                self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, self._info),
                REPORT_TIMEOUT_S)
            await self._bus.publish(subjects.node_events(self._node_id), events.NodeStopping(
                at=self._clock(), node_id=self._node_id, reason=reason))
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("node.stopping_unannounced", error=str(exc) or type(exc).__name__)

    async def _renew(self) -> None:
        """Store the node record with the next seq; only then announce the heartbeat."""
        assert self._info is not None
        now = self._clock()
        samples = self.telemetry.samples
        holdings = self.runner.task_holdings()
        info = msgspec.structs.replace(self._info, last_heartbeat=now, seq=self._info.seq + 1,
                                       samples=samples, holdings=holdings, state=self._state)
        await asyncio.wait_for(self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, info),
                               timeout=max(1.0, self._settings.heartbeat_interval))
        self._info = info
        self.lease.renewed(monotonic())
        if self.fenced:
            log.warning("node.lease_regained", incarnation=self.incarnation, seq=info.seq)
            self.fenced = False
        await self._bus.publish_core(subjects.heartbeat(self._node_id), events.NodeHeartbeat(
            at=now, node_id=self._node_id, backend=self._backend.kind, gpus=samples,
            running=self.runner.running_ids(), incarnation=self.incarnation, seq=info.seq,
            tasks=holdings))
        self.telemetry.record(now, self.incarnation, info.seq, samples, holdings)

    async def _sample_loop(self) -> None:
        """Telemetry: every `[node] sample_interval` a reading decides idle and busy; once
        per heartbeat interval it decides everything (over-share, leaks) and the heartbeat
        carries the latest reading."""
        heartbeat = self._settings.heartbeat_interval
        every = min(self._settings.sample_interval, heartbeat)
        last_full = -math.inf
        while not self._heartbeats_stop.is_set():
            started = monotonic()
            full = started - last_full >= heartbeat - every / 2
            try:
                if full:
                    last_full = started
                    await self.telemetry.tick(self.runner.views(), self._clock())
                else:
                    await self.telemetry.watch_idle(self.runner.views(), self._clock())
            except Exception as exc:  # a failed sample must not end the loop
                log.error("node.telemetry_failed", error=str(exc) or type(exc).__name__)
            self._first_sample.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeats_stop.wait(),
                                       max(0.0, every - (monotonic() - started)))

    async def _stale_loop(self) -> None:
        """Every heartbeat interval: kill attempts that were assigned elsewhere meanwhile
        (`Runner.kill_stale`). Apart from the renewals, so a slow fence read never delays
        the lease."""
        interval = self._settings.heartbeat_interval
        while not self._heartbeats_stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeats_stop.wait(), interval)
            if self._heartbeats_stop.is_set():
                return
            try:
                await asyncio.wait_for(self.runner.kill_stale(), interval)
            except Exception as exc:  # tried again next interval
                log.warning("node.stale_check_failed", error=str(exc) or type(exc).__name__)

    async def _fence_loop(self) -> None:
        """Self-fencing: when the lease lapses, this node's tasks die here, before the
        scheduler's longer lease runs out and they are started elsewhere."""
        while not self._heartbeats_stop.is_set():
            if not self.fenced and self.lease.expired(monotonic()):
                self.fenced = True
                silent = monotonic() - (self.lease.renewed_at or 0.0)
                count = self.runner.fence_all(f"lease lapsed: no renewal stored for "
                                              f"{silent:.0f}s")
                log.error("node.self_fenced", tasks=count, silent_s=round(silent, 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeats_stop.wait(), FENCE_CHECK_S)

    # ------------------------------------------------------------ commands

    async def _consume(self) -> None:
        """The command consumer, restarted if it fails, until the agent stops."""
        while not self._stop.is_set():
            try:
                await consume(self._bus.js, stream=subjects.COMMANDS_STREAM,
                              durable=subjects.node_command_consumer(self._node_id),
                              filter_subject=subjects.node_commands(self._node_id),
                              handle=self.handle, stop=self._stop)
            except Exception as exc:  # keep taking commands whatever went wrong
                log.exception("node.consumer_failed", error=str(exc) or type(exc).__name__)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)

    async def handle(self, msg: Msg) -> None:
        command = decode_or_poison(msg.data, events.decode_node_command)
        match command:
            case events.StartTask():
                await self.runner.start(command)
            case events.StopTask():
                self.runner.stop(command)
            case events.CheckpointTask():
                self.runner.request_checkpoint(command.task_id, command.attempt,
                                               command.reason)
            case events.PauseTask():
                self.runner.pause(command.task_id, command.attempt, command.reason)
            case events.ResumeTask():
                self.runner.resume(command.task_id, command.attempt, command.reason)
            case events.StageTask():
                staging = asyncio.create_task(self._stage(command))
                self._staging.add(staging)
                staging.add_done_callback(self._staging.discard)
            case events.RunMaintenance():
                # At most once: acknowledged now, answered when it ends (an agent that dies
                # meanwhile leaves the scheduler to time the window out).
                work = asyncio.create_task(self._maintain(command))
                self._staging.add(work)
                work.add_done_callback(self._staging.discard)

    async def _maintain(self, command: events.RunMaintenance) -> None:
        log.warning("node.maintenance_command", occurrence=command.occurrence,
                    command=command.command[:200], timeout_s=command.timeout_s)
        done = await run_command(command, node_id=self._node_id,
                                 running=len(self.runner.running_ids()), clock=self._clock())
        log.log(logging.INFO if done.exit_code == 0 else logging.ERROR,
                "node.maintenance_command_done", exit_code=done.exit_code, error=done.error,
                duration_s=round(done.duration_s, 2))
        await self._publish(subjects.node_events(self._node_id), done,
                            msg_id=f"maintenance-done:{self._node_id}:{command.occurrence}")

    async def _stage(self, command: events.StageTask) -> None:
        """Ready pool: read the waiting task's inputs ahead, then say so (`task_staged`)."""
        try:
            staged = await asyncio.to_thread(stage_inputs, command.inputs)
        except Exception as exc:  # reading ahead is an optimisation: never a crash
            log.warning("task.stage_failed", task_id=command.task_id,
                        error=str(exc) or type(exc).__name__)
            return
        log.info("task.staged", task_id=command.task_id, attempt=command.attempt,
                 files=staged.files, bytes=staged.bytes, seconds=round(staged.seconds, 3),
                 missing=len(staged.missing), skipped=staged.skipped)
        try:
            await self._publish(
                subjects.task_events(command.run_id, command.step,
                                    subjects.node_sender(self._node_id)), events.TaskStaged(
                    at=self._clock(), task_id=command.task_id, run_id=command.run_id,
                    step=command.step, attempt=command.attempt, node_id=self._node_id,
                    files=staged.files, bytes=staged.bytes, seconds=staged.seconds,
                    missing=staged.missing[:20], skipped=staged.skipped),
                f"{command.task_id}:{command.attempt}:staged:{self._node_id}")
        except (TimeoutError, nats.errors.Error) as exc:  # the scheduler stages again later
            log.warning("task.staged_unreported", task_id=command.task_id,
                        error=str(exc) or type(exc).__name__)

    # ------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stop taking commands, stop every task, report, and mark the node stopped."""
        self.runner.accepting = False
        self._stop.set()
        await self._announce_stopping(reason)
        await _finish(self._consumer_task, CONSUMER_STOP_TIMEOUT_S)
        count = await self.runner.stop_all(reason, self._settings.stop_grace,
                                           REPORT_TIMEOUT_S)
        self._heartbeats_stop.set()
        await _finish(self._heartbeat_task, 5.0)
        await _finish(self._fence_task, 5.0)
        await _finish(self._stale_task, 5.0)
        await _finish(self._sample_task, 5.0)
        self.lease.close()
        stop_guard(self._guard)
        if self.metrics is not None:
            await self.metrics.close()
        if self._info is None:
            return
        now = self._clock()
        try:  # the record first: whoever reacts to NodeStopped finds it "stopped"
            self._info = msgspec.structs.replace(self._info, state="stopped",
                                                 last_heartbeat=now)
            await self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, self._info)
            await self._bus.publish(subjects.node_events(self._node_id),
                                    events.NodeStopped(at=now, node_id=self._node_id,
                                                       reason=reason))
        except (TimeoutError, nats.errors.Error) as exc:
            log.error("node.stop_unreported", error=str(exc) or type(exc).__name__)
        log.info("node.stopped", tasks_stopped=count, reason=reason)


async def _finish(task: asyncio.Task[None] | None, timeout: float) -> None:
    """Let a background task end by itself within `timeout`, else cancel it."""
    if task is None:
        return
    _done, pending = await asyncio.wait([task], timeout=timeout)
    for late in pending:
        late.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await late


def _log_backend(backend: Backend, why: str) -> None:
    if backend.kind == "simulated":
        log.warning("node.gpu_backend", backend="simulated", simulated=True,
                    gpus=len(backend.gpus), detail=why)
    else:
        log.info("node.gpu_backend", backend=backend.kind, simulated=False,
                 gpus=len(backend.gpus), detail=why)


async def serve(rt: ServiceRuntime) -> None:
    """The service: what `python -m m27.node_agent` runs until SIGTERM."""
    settings = rt.config.node
    node_id = resolve_node_id(settings.id)
    spec = gpu_spec(settings)
    check_settings(settings, rt.config.scheduler.node_timeout)
    bind_contextvars(node_id=node_id)
    # Several agents on one host must not share a services key, the orchestrator finds an
    # agent by its node id, and the bus lets node N write only `node-agent.N`.
    rt.instance = node_id
    bus = await rt.connect(node_id)
    node_api = NodeServicer(rt.home, node_id, is_running=nothing_running)
    await rt.serve_grpc([node_api.register], [NODE_SERVICE])
    backend, why = await asyncio.to_thread(open_backend, spec, node_id)
    _log_backend(backend, why)
    agent = NodeAgent(bus, node_id=node_id, backend=backend, settings=settings,
                      stop=rt.stop, home=rt.home,
                      overprovision=rt.config.performance.memory_overprovision,
                      files=FileCheckpoints(level=rt.config.checkpoint.compression_level,
                                            max_bytes=rt.config.checkpoint.max_size,
                                            open_store=remote_stores(rt.api_access())),
                      api_env=lambda task, attempt: step_env(rt.api_keys, rt.config.api,
                                                             task, attempt))
    node_api.is_running = running_check(agent.runner)
    try:
        await agent.start()
        await rt.ready()
        await rt.stop.wait()
    finally:
        await agent.shutdown()
        backend.close()
