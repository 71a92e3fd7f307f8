"""The scheduler's shell: keeps the task table and node view, applies the policy's decisions.

Durable state is the tasks bucket (queued and placed tasks); nodes come from the nodes
bucket, which every node-agent refreshes with each heartbeat, and from the heartbeats
themselves. A command is acked only once its effect is in the tasks bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

import msgspec
from nats.aio.msg import Msg

from m27.common import bus as bus_module
from m27.common import events, subjects
from m27.common.bus import Bus
from m27.common.logging import bound_contextvars, get_logger
from m27.common.model import TENTHS_PER_GPU, Fence, NodeInfo
from m27.common.service import ServiceRuntime
from m27.scheduler import policy
from m27.scheduler.policy import Node, Place, Placement, QueuedTask

log = get_logger()

NODE_REFRESH_S: Final = 5.0
STOP_GRACE_S: Final = 10.0


class TaskEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One task the scheduler is responsible for, as stored in the tasks bucket."""

    task: events.EnqueueTask
    queued_at: float
    placement: Placement | None = None
    started: bool = False
    wait_reason: str = ""


class Scheduler:
    def __init__(self, bus: Bus, node_timeout: float, tick: float) -> None:
        self.bus = bus
        self.node_timeout = node_timeout
        self.tick = tick
        self.nodes: dict[str, Node] = {}
        # node → (incarnation, seq, when this scheduler saw it, on its monotonic clock).
        # Liveness is "a new renewal was seen lately", never a comparison of two machines'
        # clocks.
        self.seen: dict[str, tuple[str, int, float]] = {}
        self.entries: dict[str, TaskEntry] = {}
        self.lost: set[str] = set()
        self.wake = asyncio.Event()
        # Handlers and decisions interleave at every await; one at a time keeps the task
        # table consistent with what was published.
        self.lock = asyncio.Lock()

    async def load(self) -> None:
        """Rebuild the in-memory view from the buckets (after a restart)."""
        for key in await self.bus.kv_keys(subjects.TASKS_BUCKET):
            got = await self.bus.kv_get(subjects.TASKS_BUCKET, key, TaskEntry)
            if got is not None:
                self.entries[got[0].task.task_id] = got[0]
        await self.refresh_nodes()
        log.info("scheduler.loaded", tasks=len(self.entries), nodes=len(self.nodes))

    async def refresh_nodes(self) -> None:
        seen: dict[str, Node] = {}
        for key in await self.bus.kv_keys(subjects.NODES_BUCKET):
            got = await self.bus.kv_get(subjects.NODES_BUCKET, key, NodeInfo)
            if got is None:
                continue
            info = got[0]
            last = self._saw(info.node_id, info.incarnation, info.seq)
            seen[info.node_id] = Node(node_id=info.node_id, gpus=info.gpus,
                                      cpu_slots=info.cpu_slots, last_heartbeat=last,
                                      up=info.state == "up", stopped=info.state == "stopped")
        self.nodes = seen
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

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = events.decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if not isinstance(beat, events.NodeHeartbeat):
            return
        node = self.nodes.get(beat.node_id)
        if node is None:
            await self.refresh_nodes()
            return
        last = self._saw(beat.node_id, beat.incarnation, beat.seq)
        # (whether it takes work, `up`, comes from its record: a stopping node still beats)
        self.nodes[beat.node_id] = msgspec.structs.replace(node, last_heartbeat=last)
        if beat.node_id in self.lost:
            self.wake.set()

    async def on_node_event(self, msg: Msg) -> None:
        """A node registered or stopped: look again now rather than at the next refresh."""
        await self.refresh_nodes()

    async def on_command(self, msg: Msg) -> None:
        command = bus_module.decode_or_poison(msg.data, events.decode_scheduler_command)
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
        entry = TaskEntry(task=task, queued_at=time.time())
        await self.bus.kv_put(subjects.TASKS_BUCKET, subjects.task_key(task.task_id), entry)
        self.entries[task.task_id] = entry
        log.info("task.queued", attempt=task.attempt, gpus=task.resources.gpus,
                 urgency=task.urgency)
        self.wake.set()

    async def _cancel(self, command: events.CancelTask) -> None:
        entry = self.entries.get(command.task_id)
        if entry is None or entry.task.attempt != command.attempt:
            return
        if entry.placement is None:
            await self._forget(command.task_id)
            log.info("task.dequeued", reason=command.reason)
            return
        stop = events.StopTask(at=time.time(), task_id=command.task_id,
                               attempt=command.attempt, grace_s=STOP_GRACE_S,
                               reason=command.reason)
        await self.bus.publish(subjects.node_commands(entry.placement.node_id), stop,
                               msg_id=f"{command.task_id}:{command.attempt}:stop")
        log.info("task.stop_sent", node_id=entry.placement.node_id)

    async def on_task_event(self, msg: Msg) -> None:
        event = bus_module.decode_or_poison(msg.data, events.decode_event)
        if not isinstance(event, events.TaskStarted | events.TaskExited):
            return
        async with self.lock:
            await self._handle_task_event(event)

    async def _handle_task_event(self, event: events.TaskStarted | events.TaskExited) -> None:
        entry = self.entries.get(event.task_id)
        if entry is None or entry.task.attempt != event.attempt:
            return
        if isinstance(event, events.TaskExited):
            await self._forget(event.task_id)
            self.wake.set()
        elif not entry.started:
            await self._store(msgspec.structs.replace(entry, started=True))

    # ------------------------------------------------------------ decisions

    async def run_once(self, now: float) -> None:
        await self._declare_lost_nodes(now)
        clock = time.monotonic()
        live = [msgspec.structs.replace(n, up=policy.is_alive(n, clock, self.node_timeout))
                for n in self.nodes.values()]
        held = [e.placement for e in self.entries.values() if e.placement is not None]
        queue = [QueuedTask(task=e.task, queued_at=e.queued_at)
                 for e in self.entries.values()
                 if e.placement is None and e.task.not_before <= now]
        for decision in policy.schedule(live, held, queue):
            if isinstance(decision, Place):
                await self._start(decision, now)
            else:
                await self._note_wait(decision)

    async def _start(self, decision: Place, now: float) -> None:
        placement = decision.placement
        entry = self.entries[placement.task_id]
        task = entry.task
        if not await self._fence(task, placement.node_id, now):
            log.warning("task.stale_enqueue", task_id=task.task_id, attempt=task.attempt)
            await self._forget(task.task_id)
            return
        await self._store(msgspec.structs.replace(entry, placement=placement, wait_reason=""))
        node = self.nodes[placement.node_id]
        share = placement.gpu_tenths / TENTHS_PER_GPU if placement.gpu_ids else 0.0
        simulated = any(g.simulated for g in node.gpus if g.index in placement.gpu_ids)
        start = events.StartTask(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, step_type=task.step_type, command=task.command,
            workdir=task.workdir, env=task.env, gpu_ids=placement.gpu_ids, gpu_share=share,
            gpu_memory_mb=task.resources.gpu_memory_mb,
            checkpoint_interval_s=task.checkpoint_interval_s, timeout_s=task.timeout_s,
            outputs=task.outputs, checkpoint_signal=task.checkpoint_signal,
            cpus=task.resources.cpus, memory_mb=task.resources.memory_mb)
        key = f"{task.task_id}:{task.attempt}"
        await self.bus.publish(subjects.node_commands(placement.node_id), start,
                               msg_id=f"{key}:start")
        await self.bus.publish(subjects.task_events(task.run_id, task.step), events.TaskPlaced(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, node_id=placement.node_id, gpu_ids=placement.gpu_ids,
            gpu_share=share * len(placement.gpu_ids), gpu_simulated=simulated,
            reason=decision.reason), msg_id=f"{key}:placed")
        log.info("task.placed", task_id=task.task_id, node_id=placement.node_id,
                 gpu_ids=list(placement.gpu_ids), reason=decision.reason)

    async def _fence(self, task: events.EnqueueTask, node_id: str, now: float) -> bool:
        """Record the assignment as the task's fencing token (compare-and-set, attempts only
        grow). False when a newer attempt already holds it: this one must not run."""
        def assign(current: Fence | None) -> Fence | None:
            if current is not None and current.attempt > task.attempt:
                return None
            if current is not None and (current.attempt, current.node_id) == (task.attempt,
                                                                              node_id):
                return None
            return Fence(task_id=task.task_id, attempt=task.attempt, node_id=node_id, at=now)

        stored = await self.bus.kv_update(subjects.FENCES_BUCKET,
                                          subjects.task_key(task.task_id), Fence, assign)
        return stored is not None and (stored.attempt, stored.node_id) == (task.attempt,
                                                                            node_id)

    async def _note_wait(self, decision: policy.Wait) -> None:
        entry = self.entries[decision.task_id]
        if entry.wait_reason != decision.reason:
            log.info("task.waiting", task_id=decision.task_id, reason=decision.reason)
            await self._store(msgspec.structs.replace(entry, wait_reason=decision.reason))

    async def _declare_lost_nodes(self, now: float) -> None:
        """A node silent for longer than node_timeout is lost: its tasks are reported lost
        (and run again elsewhere, from their checkpoints). A node that stopped cleanly
        reported its tasks itself; what was placed there but never reached it is released.
        """
        clock = time.monotonic()
        for node in list(self.nodes.values()):
            if node.stopped:
                await self._release_unstarted(node, now)
                continue
            if clock - node.last_heartbeat <= self.node_timeout:
                self.lost.discard(node.node_id)
                continue
            if node.node_id in self.lost:
                continue
            self.lost.add(node.node_id)
            silent = clock - node.last_heartbeat
            log.warning("node.lost", node_id=node.node_id, silent_s=round(silent, 1))
            await self.bus.publish(subjects.node_events(node.node_id), events.NodeLost(
                at=now, node_id=node.node_id, last_heartbeat=now - silent))
            for entry in [e for e in self.entries.values()
                          if e.placement and e.placement.node_id == node.node_id]:
                await self._report_lost(entry, node.node_id, silent, now)

    async def _release_unstarted(self, node: policy.Node, now: float) -> None:
        """Tasks placed on a node that has stopped and never started them (placed while it
        was shutting down): their StartTask will not be read; they go back to be retried."""
        for entry in [e for e in self.entries.values()
                      if e.placement and e.placement.node_id == node.node_id
                      and not e.started]:
            task = entry.task
            await self.bus.publish(subjects.task_events(task.run_id, task.step),
                                   events.TaskExited(
                at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
                attempt=task.attempt, node_id=node.node_id, exit_code=None, started=False,
                cause="node_stopped", reason=f"node {node.node_id} stopped before it "
                                             "started the task"),
                msg_id=f"{task.task_id}:{task.attempt}:unstarted")
            log.warning("task.released", task_id=task.task_id, node_id=node.node_id,
                        reason="the node stopped before starting it")
            await self._forget(task.task_id)

    async def _report_lost(self, entry: TaskEntry, node_id: str, silent: float,
                           now: float) -> None:
        task = entry.task
        await self.bus.publish(subjects.task_events(task.run_id, task.step), events.TaskExited(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, node_id=node_id, exit_code=None, started=entry.started,
            cause="lost", reason=f"node {node_id} lost: no heartbeat for {silent:.0f}s"),
            msg_id=f"{task.task_id}:{task.attempt}:lost")
        await self._forget(task.task_id)

    # ------------------------------------------------------------ storage

    async def _store(self, entry: TaskEntry) -> None:
        await self.bus.kv_put(subjects.TASKS_BUCKET, subjects.task_key(entry.task.task_id),
                              entry)
        self.entries[entry.task.task_id] = entry

    async def _forget(self, task_id: str) -> None:
        await self.bus.kv_delete(subjects.TASKS_BUCKET, subjects.task_key(task_id))
        self.entries.pop(task_id, None)

    async def loop(self, stop: asyncio.Event) -> None:
        """Decide whenever something changed, and at least every tick."""
        last_refresh = 0.0
        while not stop.is_set():
            now = time.time()
            if now - last_refresh >= NODE_REFRESH_S:
                await self.refresh_nodes()
                last_refresh = now
            self.wake.clear()
            async with self.lock:
                await self.run_once(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=self.tick)


async def serve(rt: ServiceRuntime) -> None:
    bus = await rt.connect()
    scheduler = Scheduler(bus, rt.config.scheduler.node_timeout, rt.config.scheduler.tick)
    await rt.serve_grpc()
    # Listen before loading: a node that registers in between is then seen by one or the
    # other, never by neither (which would leave it unused until the next refresh).
    heartbeats = await bus.nc.subscribe(subjects.HEARTBEAT_ALL, cb=scheduler.on_heartbeat)
    node_events = await bus.nc.subscribe(subjects.NODE_EVENTS_ALL, cb=scheduler.on_node_event)
    await bus.nc.flush()
    await scheduler.load()
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.COMMANDS_STREAM, durable=subjects.SCHEDULER_COMMAND_CONSUMER,
        filter_subject=subjects.SCHEDULER_COMMANDS, handle=scheduler.on_command,
        stop=rt.stop), "commands")
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable=subjects.SCHEDULER_TASK_EVENTS,
        filter_subject=subjects.TASK_EVENTS_ALL, handle=scheduler.on_task_event,
        stop=rt.stop), "task-events")
    rt.spawn(scheduler.loop(rt.stop), "decisions")
    await rt.ready()
    await rt.stop.wait()
    await heartbeats.unsubscribe()
    await node_events.unsubscribe()
