"""The scheduler's shell: keeps the task table and node view, runs the policy, applies its
decisions.

Durable state is the tasks bucket (queued and placed tasks, `_state.TaskEntry`) and the
maintenance bucket (cordoned and draining nodes); nodes come from the nodes bucket, which
every node-agent refreshes with each renewal, and from the heartbeats themselves (the
latest GPU readings). Task events keep the table current: started, exited, and idle / busy
(the I/O stalls backfill uses). A command is acked only once its effect is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import Final

import msgspec
from nats.aio.msg import Msg

from m27.common import bus as bus_module
from m27.common import events, platform, subjects
from m27.common.bus import Bus, until_settled
from m27.common.errors import ConfigError
from m27.common.ids import is_valid_task_id
from m27.common.leader import FencedBus, Leadership
from m27.common.logging import bound_contextvars, get_logger
from m27.common.metrics import MetricsServer
from m27.common.model import NodeInfo
from m27.common.service import ServiceRuntime
from m27.common.windows import Window, WindowError, parse_config
from m27.scheduler import api, policy
from m27.scheduler._apply import Effects, Table
from m27.scheduler._state import (
    Maintenance,
    MaintenanceState,
    NodeView,
    TaskEntry,
    UnknownNode,
    attempt_gpu_s,
    cluster_state,
    policy_settings,
    queue_of,
)
from m27.scheduler._window_shell import Windows
from m27.scheduler.model import ClusterState, PolicySettings, Queued

log = get_logger()

NODE_REFRESH_S: Final = 5.0
CYCLE_RETRY_MAX_S: Final = 30.0  # the longest pause after failed scheduling cycles
STOP_GRACE_S: Final = 10.0


class Scheduler:
    def __init__(self, bus: Bus, node_timeout: float, tick: float,
                 settings: PolicySettings | None = None) -> None:
        self.bus = bus
        self.node_timeout = node_timeout
        self.tick = tick
        self.settings = settings or PolicySettings()
        self.nodes: dict[str, NodeInfo] = {}
        # node → (incarnation, seq, when this scheduler saw it, on its monotonic clock).
        # Liveness is "a new renewal was seen lately", never a comparison of two machines'
        # clocks.
        self.seen: dict[str, tuple[str, int, float]] = {}
        self.maintenance: dict[str, Maintenance] = {}
        self.table = Table(bus)
        self.effects = Effects(bus, self.table)
        self.lost: set[str] = set()
        #: node → the platform differences last reported for it (NodePlatformDiffers)
        self.platform_said: dict[str, tuple[str, ...]] = {}
        self.windows = Windows(bus, lambda: self.maintenance, self.tasks_on)
        self.configured_windows: list[Window] = []  # [scheduler] windows
        self.wake = asyncio.Event()
        # Handlers and decisions interleave at every await; one at a time keeps the task
        # table consistent with what was published.
        self.lock = asyncio.Lock()

    def reset(self) -> None:
        """Forget what this copy knew (it rebuilds from the buckets in `load`)."""
        self.nodes, self.seen, self.maintenance = {}, {}, {}
        self.lost.clear()
        self.platform_said.clear()
        self.windows.records.clear()
        self.table.entries.clear()

    @property
    def entries(self) -> dict[str, TaskEntry]:
        return self.table.entries

    async def load(self) -> None:
        """Rebuild the in-memory view from the buckets (after a restart)."""
        for key in await self.bus.kv_keys(subjects.TASKS_BUCKET):
            got = await self.bus.kv_get(subjects.TASKS_BUCKET, key, TaskEntry)
            if got is not None:
                self.entries[got[0].task.task_id] = got[0]
        await self.refresh_nodes()
        await self.windows.load()
        await self.windows.apply_config(self.configured_windows, time.time())
        log.info("scheduler.loaded", tasks=len(self.entries), nodes=len(self.nodes),
                 maintenance=len(self.maintenance), windows=len(self.windows.records))

    async def refresh_nodes(self) -> None:
        seen: dict[str, NodeInfo] = {}
        for key in await self.bus.kv_keys(subjects.NODES_BUCKET):
            got = await self.bus.kv_get(subjects.NODES_BUCKET, key, NodeInfo)
            if got is None:
                continue
            info = got[0]
            self._saw(info.node_id, info.incarnation, info.seq)
            before = self.nodes.get(info.node_id)
            if before is not None and before.incarnation == info.incarnation and \
                    before.seq > info.seq:  # a heartbeat already brought newer readings
                info = msgspec.structs.replace(info, samples=before.samples, seq=before.seq)
            seen[info.node_id] = info
        self.nodes = seen
        held: dict[str, Maintenance] = {}
        for key in await self.bus.kv_keys(subjects.MAINTENANCE_BUCKET):
            mark = await self.bus.kv_get(subjects.MAINTENANCE_BUCKET, key, Maintenance)
            if mark is not None:
                held[mark[0].node_id] = mark[0]
        self.maintenance = held
        self.wake.set()

    # ------------------------------------------------------------ inputs

    def _saw(self, node_id: str, incarnation: str, seq: int) -> float:
        """Record a renewal; returns when the node's latest renewal was first seen here.

        A node first seen by this scheduler (after its own restart) gets a full lease from
        now: it is declared lost only if it then stays silent for node_timeout."""
        now = time.monotonic()
        before = self.seen.get(node_id)
        if before is None or before[0] != incarnation or seq > before[1]:
            self.seen[node_id] = (incarnation, seq, now)
        return self.seen[node_id][2]

    def _last_heartbeat(self, node_id: str) -> float:
        return self.seen.get(node_id, ("", 0, 0.0))[2]

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = events.decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if not isinstance(beat, events.NodeHeartbeat):
            return
        if msg.subject != subjects.heartbeat(beat.node_id):
            # Each node may publish only its own heartbeat subject (m27.common.principals):
            # a beat naming another node is forged.
            log.warning("heartbeat.wrong_subject", subject=msg.subject[:200],
                        node_id=beat.node_id[:200])
            return
        node = self.nodes.get(beat.node_id)
        if node is None:
            await self.refresh_nodes()
            return
        self._saw(beat.node_id, beat.incarnation, beat.seq)
        # (whether it takes work, `up`, comes from its record: a stopping node still beats)
        if beat.incarnation == node.incarnation and beat.seq >= node.seq:
            self.nodes[beat.node_id] = msgspec.structs.replace(node, samples=beat.gpus,
                                                               seq=beat.seq)
        if beat.node_id in self.lost:
            self.wake.set()

    async def on_node_event(self, msg: Msg) -> None:
        """A node registered or stopped: look again now rather than at the next refresh. A
        maintenance command's answer moves its window on (from that node's own subject)."""
        try:
            event = events.decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            event = None
        if isinstance(event, events.MaintenanceCommandDone):
            if msg.subject == subjects.node_events(event.node_id):
                async with self.lock:
                    await self.windows.command_done(event, time.time())
                self.wake.set()
            return
        await self.refresh_nodes()

    async def on_command(self, msg: Msg) -> None:
        command = bus_module.decode_or_poison(msg.data, events.decode_scheduler_command)
        if not is_valid_task_id(command.task_id):  # it names KV keys and node subjects
            raise bus_module.PoisonMessage(f"not a task id: {command.task_id[:200]!r}")
        async with self.lock:
            with bound_contextvars(task_id=command.task_id):
                await self._handle_command(command)

    async def _handle_command(self, command: events.SchedulerCommand) -> None:
        if isinstance(command, events.EnqueueTask):
            await self._enqueue(command)
        else:
            await self._cancel(command)

    async def _enqueue(self, task: events.EnqueueTask) -> None:
        current = self.entries.get(task.task_id)
        if current is not None and current.task.attempt >= task.attempt:
            return  # a redelivery
        # A preempted task comes back with its first queue time and the GPU time it held.
        queued_at = task.queued_at if task.queued_at > 0 else time.time()
        entry = TaskEntry(task=task, queued_at=queued_at, attained_gpu_s=task.attained_gpu_s)
        await self.table.store(entry)
        log.info("task.queued", attempt=task.attempt, gpus=task.resources.gpus,
                 urgency=task.urgency, requeued=task.queued_at > 0)
        self.wake.set()

    async def _cancel(self, command: events.CancelTask) -> None:
        entry = self.entries.get(command.task_id)
        if entry is None or entry.task.attempt != command.attempt:
            return
        if entry.placement is None:
            await self.table.forget(command.task_id)
            log.info("task.dequeued", reason=command.reason)
            return
        node_id = entry.placement.node_id
        if entry.paused:  # a stopped process cannot act on SIGTERM: continue it first
            await self.bus.publish(subjects.node_commands(node_id), events.ResumeTask(
                at=time.time(), task_id=command.task_id, attempt=command.attempt,
                reason="cancelled"), msg_id=f"{command.task_id}:{command.attempt}:cancel-resume")
        stop = events.StopTask(at=time.time(), task_id=command.task_id,
                               attempt=command.attempt, grace_s=STOP_GRACE_S,
                               reason=command.reason)
        await self.bus.publish(subjects.node_commands(node_id), stop,
                               msg_id=f"{command.task_id}:{command.attempt}:stop")
        log.info("task.stop_sent", node_id=node_id)

    async def on_task_event(self, msg: Msg) -> None:
        event = await bus_module.task_event_or_poison(self.bus, msg.subject, msg.data)
        if not isinstance(event, events.TaskStarted | events.TaskExited | events.TaskIdle
                          | events.TaskBusy | events.CheckpointCommitted
                          | events.TaskStaged):
            return
        async with self.lock:
            await self._handle_task_event(event)

    async def _handle_task_event(self, event: events.TaskStarted | events.TaskExited
                                 | events.TaskIdle | events.TaskBusy
                                 | events.CheckpointCommitted | events.TaskStaged) -> None:
        entry = self.table.current(event.task_id, event.attempt)
        if entry is None:
            return
        match event:
            case events.TaskExited():
                await self.table.forget(event.task_id)
                log.info("task.freed", task_id=event.task_id, cause=event.cause,
                         gpu_s=round(attempt_gpu_s(entry, event.at), 1))
                self.wake.set()
            case events.TaskStarted():
                if not entry.started:
                    await self.table.store(msgspec.structs.replace(
                        entry, started=True, started_at=event.at))
            case events.CheckpointCommitted():
                # (the store's clock: the policy compares it with its own `now`)
                if entry.last_checkpoint_at is None or event.at > entry.last_checkpoint_at:
                    await self.table.store(msgspec.structs.replace(
                        entry, last_checkpoint_at=event.at))
            case events.TaskStaged():
                if entry.placement is None and event.node_id in entry.staging_nodes:
                    await self.table.store(msgspec.structs.replace(
                        entry, staged_nodes=(*entry.staged_nodes, event.node_id),
                        staging_nodes=tuple(n for n in entry.staging_nodes
                                            if n != event.node_id)))
                    log.info("task.staged", task_id=event.task_id, node_id=event.node_id,
                             files=event.files, bytes=event.bytes,
                             seconds=round(event.seconds, 3), missing=list(event.missing))
                    self.wake.set()
            case events.TaskIdle() | events.TaskBusy():
                idle = isinstance(event, events.TaskIdle)
                if entry.idle != idle:
                    await self.table.store(msgspec.structs.replace(entry, idle=idle))
                    log.info("task.idle" if idle else "task.busy", task_id=event.task_id,
                             utilization_pct=event.utilization_pct)
                    self.wake.set()

    # ------------------------------------------------------------ decisions

    def _views(self) -> list[NodeView]:
        clock = time.monotonic()
        return [NodeView(info=info, alive=info.state == "up" and clock - self._last_heartbeat(
                    info.node_id) <= self.node_timeout)
                for info in self.nodes.values()]

    def snapshot(self, now: float) -> tuple[ClusterState, list[Queued]]:
        """What the policy sees now."""
        return (cluster_state(self._views(), self.maintenance, self.entries.values(),
                              self.windows.near(now)),
                queue_of(self.entries.values(), now))

    async def run_once(self, now: float) -> None:
        await self._declare_lost_nodes(now)
        await self.windows.tick(now)
        await self._report_platforms(now)
        await self.effects.resend_starts(self.nodes, {view.info.node_id for view in
                                                      self._views() if view.alive}, now)
        state, queue = self.snapshot(now)
        for decision in policy.decide(state, queue, now, self.settings):
            await self.effects.apply(decision, self.nodes, now)

    # ------------------------------------------------------------ maintenance

    async def set_maintenance(self, node_id: str, state: MaintenanceState | None,
                              reason: str) -> Maintenance | None:
        """Cordon (no new work), drain (no new work; checkpointing tasks are moved off),
        or uncordon (`state` None). Stored before it is answered, so it survives restarts.
        """
        async with self.lock:
            if node_id not in self.nodes and node_id not in self.maintenance:
                raise UnknownNode(node_id)
            if state is None:
                await self.bus.kv_delete(subjects.MAINTENANCE_BUCKET, node_id)
                self.maintenance.pop(node_id, None)
                log.info("node.uncordoned", node_id=node_id, reason=reason)
                self.wake.set()
                return None
            mark = Maintenance(node_id=node_id, state=state, reason=reason, at=time.time())
            await self.bus.kv_put(subjects.MAINTENANCE_BUCKET, node_id, mark)
            self.maintenance[node_id] = mark
            log.info(f"node.{state}", node_id=node_id, reason=reason)
            self.wake.set()
            return mark

    def tasks_on(self, node_id: str) -> int:
        return sum(1 for e in self.entries.values()
                   if e.placement is not None and e.placement.node_id == node_id)

    # ------------------------------------------------------------ lost and stopped nodes

    async def _declare_lost_nodes(self, now: float) -> None:
        """A node silent for longer than node_timeout is lost: its tasks are reported lost
        (and run again elsewhere, from their checkpoints). A node that stopped cleanly
        reported its tasks itself; what was placed there but never reached it is released.
        """
        clock = time.monotonic()
        for node in list(self.nodes.values()):
            if node.state == "stopped":
                await self._release_unstarted(node.node_id, now)
                continue
            silent = clock - self._last_heartbeat(node.node_id)
            if silent <= self.node_timeout:
                self.lost.discard(node.node_id)
                continue
            if node.node_id in self.lost:
                continue
            self.lost.add(node.node_id)
            log.warning("node.lost", node_id=node.node_id, silent_s=round(silent, 1))
            await self.bus.publish(subjects.node_events(node.node_id), events.NodeLost(
                at=now, node_id=node.node_id, last_heartbeat=now - silent))
            for entry in [e for e in self.entries.values()
                          if e.placement and e.placement.node_id == node.node_id]:
                await self._report_lost(entry, node.node_id, silent, now)

    async def _report_platforms(self, now: float) -> None:
        """A live node whose driver or CUDA differs from most live nodes' is reported once
        (`node_platform_differs`), and again when that changes or it agrees again. A
        restarted scheduler reports what it finds; the message id keeps a restart within
        JetStream's duplicate window from repeating it."""
        views = self._views()
        found = platform.differences({v.info.node_id: v.info.platform
                                      for v in views if v.alive})
        for view in views:
            info = view.info
            said = self.platform_said.get(info.node_id, ())
            now_differs = found.get(info.node_id, ())
            if now_differs == said or (not view.alive and not now_differs):
                continue  # unchanged; a node that is down is not said to agree
            self.platform_said[info.node_id] = now_differs
            log.warning("node.platform_differs", node_id=info.node_id,
                        differences=list(now_differs))
            digest = hashlib.sha256("\x1f".join(now_differs).encode()).hexdigest()[:16]
            await self.bus.publish(
                subjects.node_events(info.node_id),
                events.NodePlatformDiffers(at=now, node_id=info.node_id,
                                           differences=now_differs, platform=info.platform),
                msg_id=f"node-platform:{info.node_id}:{info.incarnation}:{digest}")

    async def _release_unstarted(self, node_id: str, now: float) -> None:
        """Tasks placed on a node that has stopped and never started them (placed while it
        was shutting down): their StartTask will not be read; they go back to be retried."""
        for entry in [e for e in self.entries.values()
                      if e.placement and e.placement.node_id == node_id and not e.started]:
            task = entry.task
            await self.bus.publish(subjects.task_events(task.run_id, task.step,
                                                    subjects.SCHEDULER_SENDER),
                                   events.TaskExited(
                at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
                attempt=task.attempt, node_id=node_id, exit_code=None, started=False,
                cause="node_stopped", reason=f"node {node_id} stopped before it "
                                             "started the task"),
                msg_id=f"{task.task_id}:{task.attempt}:unstarted")
            log.warning("task.released", task_id=task.task_id, node_id=node_id,
                        reason="the node stopped before starting it")
            await self.table.forget(task.task_id)

    async def _report_lost(self, entry: TaskEntry, node_id: str, silent: float,
                           now: float) -> None:
        task = entry.task
        await self.bus.publish(subjects.task_events(task.run_id, task.step,
                                                    subjects.SCHEDULER_SENDER), events.TaskExited(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, node_id=node_id, exit_code=None, started=entry.started,
            cause="lost", reason=f"node {node_id} lost: no heartbeat for {silent:.0f}s"),
            msg_id=f"{task.task_id}:{task.attempt}:lost")
        await self.table.forget(task.task_id)

    async def loop(self, stop: asyncio.Event) -> None:
        """Decide whenever something changed, and at least every tick. A failed cycle (NATS
        unreachable for a while, a bug in the policy) is logged and tried again after a
        growing pause: the commands and events already queued stay durable meanwhile, and
        the service stays up to answer and to recover."""
        last_refresh, failures = 0.0, 0
        while not stop.is_set():
            now = time.time()
            pause = self.tick
            self.wake.clear()
            try:
                if now - last_refresh >= NODE_REFRESH_S:
                    await self.refresh_nodes()
                    last_refresh = now
                async with self.lock:
                    began = time.perf_counter()
                    await self.run_once(now)
                    self.effects.metrics.cycled(time.perf_counter() - began)
                failures = 0
            except Exception as exc:
                failures += 1
                pause = min(CYCLE_RETRY_MAX_S, self.tick * 2 ** min(failures, 10))
                log.exception("scheduler.cycle_failed", error=str(exc) or type(exc).__name__,
                              failures=failures, retry_in_s=pause)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=pause)


async def serve(rt: ServiceRuntime) -> None:
    """Serve the API at once; act (consume, decide) only while this copy holds the
    scheduler's lease (`m27.common.leader`): a second copy is a standby."""
    nats = await rt.connect()
    leadership = Leadership(nats, "scheduler", rt.instance, ttl_s=rt.config.scheduler.lease)
    settings = policy_settings(rt.config)
    scheduler = Scheduler(FencedBus(nats, leadership), rt.config.scheduler.node_timeout,
                          rt.config.scheduler.tick, settings)
    try:
        scheduler.configured_windows = parse_config(rt.config.scheduler.windows)
    except WindowError as exc:
        raise ConfigError(str(exc)) from None
    await rt.serve_grpc([api.SchedulerServicer(scheduler).register],
                        api.SERVICE_NAMES)
    metrics = await _start_metrics(rt.config.scheduler.metrics_bind, scheduler)

    async def act() -> None:
        scheduler.reset()  # a copy that acts again starts from the buckets, not its memory
        # Listen before loading: a node that registers in between is then seen by one or
        # the other, never by neither (which would leave it unused until the next refresh).
        heartbeats = await nats.nc.subscribe(subjects.HEARTBEAT_ALL, cb=scheduler.on_heartbeat)
        node_events = await nats.nc.subscribe(subjects.NODE_EVENTS_ALL,
                                              cb=scheduler.on_node_event)
        try:
            await nats.nc.flush()
            # (a fresh or healing cluster may not answer at once: asked again meanwhile)
            await until_settled(scheduler.load, what="the scheduler's state", stop=rt.stop)
            await rt.ready(metrics_address=metrics[1] if metrics else "")
            async with asyncio.TaskGroup() as acting:
                acting.create_task(bus_module.consume(
                    nats.js, stream=subjects.COMMANDS_STREAM,
                    durable=subjects.SCHEDULER_COMMAND_CONSUMER,
                    filter_subject=subjects.SCHEDULER_COMMANDS, handle=scheduler.on_command,
                    stop=rt.stop))
                acting.create_task(bus_module.consume(
                    nats.js, stream=subjects.EVENTS_STREAM,
                    durable=subjects.SCHEDULER_TASK_EVENTS,
                    filter_subject=subjects.TASK_EVENTS_ALL, handle=scheduler.on_task_event,
                    stop=rt.stop))
                acting.create_task(scheduler.loop(rt.stop))
        finally:
            with contextlib.suppress(Exception):
                await heartbeats.unsubscribe()
                await node_events.unsubscribe()
            if rt.is_ready and not rt.stop.is_set():  # deposed: a standby again
                await rt.unready()

    rt.spawn(leadership.run(act, rt.stop), "leadership")
    try:
        await rt.stop.wait()
    finally:
        if metrics:
            await metrics[0].close()


async def _start_metrics(bind: str, scheduler: Scheduler) -> tuple[MetricsServer, str] | None:
    """Prometheus /metrics (preemptions, decisions), if `[scheduler] metrics_bind` is set."""
    if not bind:
        return None
    try:
        server = MetricsServer(bind, scheduler.effects.metrics.render)
    except ValueError as exc:
        raise ConfigError(f"[scheduler] metrics_bind = {bind!r}: {exc}") from exc
    address = await server.start()
    log.info("scheduler.metrics", address=f"http://{address}/metrics")
    return server, address
