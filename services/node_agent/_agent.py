"""The node-agent service: register the node, heartbeat, take commands, shut down cleanly.

Order of work: NATS and gRPC up → GPU backend chosen → leftovers of an earlier agent reaped
→ NodeInfo stored and NodeRegistered published → heartbeats and the command consumer run →
ready. On SIGTERM: no new commands, every task stopped and its exit reported, NodeStopped
published, NodeInfo marked "stopped".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Final

import msgspec
import nats.errors
from nats.aio.msg import Msg

from m27 import __version__
from m27.common import events, subjects
from m27.common.bus import Bus, consume, decode_or_poison
from m27.common.config import NodeSection
from m27.common.logging import bind_contextvars, get_logger
from m27.common.model import NodeInfo
from m27.common.paths import m27_home
from m27.common.service import ServiceRuntime
from m27.node_agent._backends import Backend, open_backend
from m27.node_agent._cli import check_settings, cpu_slots, gpu_spec, resolve_node_id
from m27.node_agent._runner import TaskRunner
from m27.node_agent._tasks import NodeContext

log = get_logger()

STOPPED_REASON: Final = "node agent stopped"
#: After the tasks' grace: how long shutdown waits for their exits to reach the bus.
REPORT_TIMEOUT_S: Final = 15.0
CONSUMER_STOP_TIMEOUT_S: Final = 15.0


class NodeAgent:
    """One node: its registration, heartbeats, command consumer and tasks."""

    def __init__(self, bus: Bus, *, node_id: str, backend: Backend, settings: NodeSection,
                 stop: asyncio.Event, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._node_id = node_id
        self._backend = backend
        self._settings = settings
        self._stop = stop
        self._clock = clock
        context = NodeContext(node_id=node_id, backend=backend.kind, gpus=backend.gpus,
                              home=m27_home(), python=sys.executable)
        self.runner = TaskRunner(bus, context, stop_grace_s=settings.stop_grace,
                                 environ=os.environ if environ is None else environ,
                                 clock=clock)
        self._info: NodeInfo | None = None
        self._heartbeats_stop = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._consumer_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.runner.recover()
        await self._register()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")
        self._consumer_task = asyncio.create_task(self._consume(), name="node commands")

    async def _register(self) -> None:
        now = self._clock()
        info = NodeInfo(node_id=self._node_id, hostname=socket.gethostname(),
                        backend=self._backend.kind, gpus=self._backend.gpus,
                        cpu_slots=cpu_slots(self._settings), registered_at=now,
                        last_heartbeat=now, pid=os.getpid(), version=__version__)
        await self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, info)
        self._info = info
        await self._bus.publish(subjects.node_events(self._node_id), events.NodeRegistered(
            at=now, node_id=self._node_id, hostname=info.hostname, backend=info.backend,
            gpus=info.gpus, cpu_slots=info.cpu_slots))
        log.info("node.registered", backend=info.backend, gpus=len(info.gpus),
                 simulated=info.backend == "simulated", cpu_slots=info.cpu_slots)

    # ------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        interval = self._settings.heartbeat_interval
        while not self._heartbeats_stop.is_set():
            try:
                await self._heartbeat()
            except Exception as exc:  # a missed beat must not end the loop
                log.warning("node.heartbeat_failed", error=str(exc) or type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeats_stop.wait(), interval)

    async def _heartbeat(self) -> None:
        now = self._clock()
        holdings = self.runner.holdings()
        try:
            samples = await asyncio.to_thread(self._backend.sample, holdings, now)
        except Exception as exc:  # NVML can fail (GPU lost); the node is still alive
            log.error("node.gpu_sample_failed", backend=self._backend.kind, error=str(exc))
            samples = ()
        await self._bus.publish_core(subjects.heartbeat(self._node_id), events.NodeHeartbeat(
            at=now, node_id=self._node_id, backend=self._backend.kind, gpus=samples,
            running=self.runner.running_ids()))
        if self._info is not None:
            self._info = msgspec.structs.replace(self._info, last_heartbeat=now)
            await self._bus.kv_put(subjects.NODES_BUCKET, self._node_id, self._info)

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

    # ------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str = STOPPED_REASON) -> None:
        """Stop taking commands, stop every task, report, and mark the node stopped."""
        self.runner.accepting = False
        self._stop.set()
        await _finish(self._consumer_task, CONSUMER_STOP_TIMEOUT_S)
        count = await self.runner.stop_all(reason, self._settings.stop_grace,
                                           REPORT_TIMEOUT_S)
        self._heartbeats_stop.set()
        await _finish(self._heartbeat_task, 5.0)
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
    check_settings(settings)
    bind_contextvars(node_id=node_id)
    if not rt.args.instance:
        rt.instance = node_id  # several agents on one host must not share a services key
    bus = await rt.connect()
    await rt.serve_grpc()
    backend, why = await asyncio.to_thread(open_backend, spec, node_id)
    _log_backend(backend, why)
    agent = NodeAgent(bus, node_id=node_id, backend=backend, settings=settings,
                      stop=rt.stop)
    try:
        await agent.start()
        await rt.ready()
        await rt.stop.wait()
    finally:
        await agent.shutdown()
        backend.close()
