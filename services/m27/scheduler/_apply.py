"""Carrying out the policy's decisions: each becomes node commands, events and a stored entry.

Every decision is idempotent under redelivery and restarts: its effect is recorded in the
task's entry (placement, `stopping`, `paused`) before or together with the command, each
command has a stable `Nats-Msg-Id` (JetStream drops the duplicate), and a decision whose
effect is already recorded is skipped. The fencing token makes sure a placement of a stale
attempt never runs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final

import msgspec

from m27.common import events, subjects
from m27.common.bus import Bus
from m27.common.logging import get_logger
from m27.common.model import Fence, NodeInfo
from m27.scheduler._state import Placement, TaskEntry
from m27.scheduler.metrics import SchedulerMetrics, preemption_kind
from m27.scheduler.model import MILLI_PER_GPU, Decision, Pause, Place, Preempt, Resume, Stage, Wait

log = get_logger()

#: A placed task its node has not reported started is sent its StartTask again, this long
#: after the placement and then after doubling pauses up to START_RESEND_MAX_S. The first
#: send can fail after the placement is stored (a clustered JetStream electing the commands
#: stream's leader refuses publishes for seconds); without this the run waits for ever.
#: A resend is harmless: JetStream drops it within its duplicate window (the same message
#: id), and after that the agent's ledger does (it runs an attempt once, and publishes its
#: TaskStarted again).
START_RESEND_S: Final = 10.0
START_RESEND_MAX_S: Final = 300.0
#: A waiting task's changed reason is written to the tasks bucket at most this often (the
#: API shows the latest from memory): a reason quotes live figures that change nearly every
#: cycle, and a write per waiting task per cycle was most of a cycle with 10,000 queued.
WAIT_STORE_S: Final = 60.0
#: How long a task's fence outlives the task (`expire_fence`).
FENCE_KEPT_S: Final = 24 * 3600.0


def start_resend_due(placed_at: float, sends: int, last_sent: float, now: float) -> bool:
    """Whether a placed, unstarted task's StartTask is due again (`sends` resends so far,
    the latest at `last_sent`; placed_at when there was none)."""
    if sends == 0:
        return now - placed_at >= START_RESEND_S
    pause = min(START_RESEND_S * 2.0 ** min(sends, 16), START_RESEND_MAX_S)
    return now - last_sent >= pause


async def expire_fence(bus: Bus, task_id: str, attempt: int) -> None:
    """Write the task's fence again with a TTL of FENCE_KEPT_S, if it is still `attempt`'s
    (a newer attempt's fence stays as it is). Without it a fence stayed for every task
    ever run. An attempt cut off from NATS fences itself within seconds (its lease), so a
    day leaves the checkpoint-store and the agents all the time they need to refuse it; a
    next attempt placed later writes a fence of its own, without a TTL."""
    def same(current: Fence | None) -> Fence | None:
        return current if current is not None and current.attempt == attempt else None

    await bus.kv_update(subjects.FENCES_BUCKET, subjects.task_key(task_id), Fence, same,
                        ttl_s=FENCE_KEPT_S)


class Table:
    """The task table: in memory, and durably in the tasks bucket."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.entries: dict[str, TaskEntry] = {}
        #: task id → when its entry was last written to the bucket (scheduler's clock)
        self.stored_at: dict[str, float] = {}

    async def store(self, entry: TaskEntry, now: float | None = None) -> None:
        await self.bus.kv_put(subjects.TASKS_BUCKET, subjects.task_key(entry.task.task_id),
                              entry)
        self.entries[entry.task.task_id] = entry
        if now is not None:
            self.stored_at[entry.task.task_id] = now

    def note(self, entry: TaskEntry) -> None:
        """Change the entry in memory only: for what a restarted scheduler works out again
        at once (a wait reason, a node staged for a task that reads nothing)."""
        self.entries[entry.task.task_id] = entry

    async def forget(self, task_id: str) -> None:
        """The task is over (or its attempt is, until the orchestrator enqueues the next):
        out of the table, and its fence kept for FENCE_KEPT_S more, then removed by NATS."""
        entry = self.entries.get(task_id)
        await self.bus.kv_delete(subjects.TASKS_BUCKET, subjects.task_key(task_id))
        if entry is not None:
            await expire_fence(self.bus, entry.task.task_id, entry.task.attempt)
        self.entries.pop(task_id, None)
        self.stored_at.pop(task_id, None)

    def current(self, task_id: str, attempt: int | None = None) -> TaskEntry | None:
        entry = self.entries.get(task_id)
        if entry is None or (attempt is not None and entry.task.attempt != attempt):
            return None
        return entry


class Effects:
    """Applies decisions to the table and the bus, and counts what it carried out."""

    def __init__(self, bus: Bus, table: Table,
                 metrics: SchedulerMetrics | None = None) -> None:
        self.bus = bus
        self.table = table
        self.metrics = metrics or SchedulerMetrics()
        #: (task id, attempt) → (StartTask resends, when the latest was sent)
        self.resends: dict[tuple[str, int], tuple[int, float]] = {}

    async def apply(self, decision: Decision, nodes: Mapping[str, NodeInfo],
                    now: float) -> bool:
        """Carry the decision out; False when it had no effect (already done, or moot)."""
        done = False
        match decision:
            case Place():
                done = await self.place(decision, nodes, now)
            case Preempt():
                done = await self.preempt(decision, now)
            case Pause() | Resume():
                done = await self.signal(decision, now)
            case Stage():
                done = await self.stage(decision, now)
            case Wait():
                done = await self.wait(decision, now)
        if done:
            self.metrics.decided(decision)
        return done

    # ------------------------------------------------------------ place

    async def place(self, decision: Place, nodes: Mapping[str, NodeInfo], now: float) -> bool:
        entry = self.table.current(decision.task_id, decision.attempt)
        node = nodes.get(decision.node_id)
        if entry is None or entry.placement is not None or node is None:
            return False  # already placed (a decision made twice), or gone meanwhile
        task = entry.task
        if not await self._fence(task, decision.node_id, now):
            log.warning("task.stale_enqueue", task_id=task.task_id, attempt=task.attempt)
            await self.table.forget(task.task_id)
            return False
        placement = Placement(task_id=task.task_id, attempt=task.attempt,
                              node_id=decision.node_id, gpu_ids=decision.gpu_ids,
                              gpu_milli=decision.gpu_milli if decision.gpu_ids else 0,
                              cpus=task.resources.cpus, lender=decision.lender)
        await self.table.store(msgspec.structs.replace(
            entry, placement=placement, placed_at=now, wait_reason="", idle=False,
            paused=False, stopping="", stopping_for=""))
        await self._send_start(task, placement, node, decision.reason, now)
        log.info("task.placed", task_id=task.task_id, node_id=placement.node_id,
                 gpu_ids=list(placement.gpu_ids), gpu_milli=placement.gpu_milli,
                 lender=placement.lender, reason=decision.reason)
        return True

    async def resend_starts(self, nodes: Mapping[str, NodeInfo], alive: Collection[str],
                            now: float) -> int:
        """Send StartTask again for placed tasks on live nodes that have not started
        (`START_RESEND_S`); returns how many were sent."""
        waiting = {(e.task.task_id, e.task.attempt): e for e in self.table.entries.values()
                   if e.placement is not None and not e.started and not e.stopping}
        self.resends = {key: sent for key, sent in self.resends.items() if key in waiting}
        sent = 0
        for key, entry in waiting.items():
            assert entry.placement is not None
            node = nodes.get(entry.placement.node_id)
            sends, last = self.resends.get(key, (0, entry.placed_at))
            if node is None or node.node_id not in alive or not start_resend_due(
                    entry.placed_at, sends, last, now):
                continue
            self.resends[key] = (sends + 1, now)  # before the send: a failure waits too
            await self._send_start(entry.task, entry.placement, node, "sent again: not "
                                   "started yet", now)
            log.warning("task.start_resent", task_id=key[0], attempt=key[1],
                        node_id=node.node_id, resends=sends + 1,
                        placed_s_ago=round(now - entry.placed_at, 1))
            sent += 1
        return sent

    async def _send_start(self, task: events.EnqueueTask, placement: Placement,
                          node: NodeInfo, reason: str, now: float) -> None:
        share = placement.gpu_milli / MILLI_PER_GPU if placement.gpu_ids else 0.0
        simulated = any(g.simulated for g in node.gpus if g.index in placement.gpu_ids)
        start = events.StartTask(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, step_type=task.step_type, command=task.command,
            workdir=task.workdir, env=task.env, secrets=task.secrets,
            gpu_ids=placement.gpu_ids, gpu_share=share,
            gpu_memory_mb=task.resources.gpu_memory_mb,
            checkpoint_interval_s=task.checkpoint_interval_s, timeout_s=task.timeout_s,
            outputs=task.outputs, checkpoint_signal=task.checkpoint_signal, monitor=task.monitor,
            cpus=task.resources.cpus, memory_mb=task.resources.memory_mb)
        key = f"{task.task_id}:{task.attempt}"
        await self.bus.publish(subjects.node_commands(placement.node_id), start,
                               msg_id=f"{key}:start")
        placed = subjects.task_events(task.run_id, task.step, subjects.SCHEDULER_SENDER)
        await self.bus.publish(placed, events.TaskPlaced(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, node_id=placement.node_id, gpu_ids=placement.gpu_ids,
            gpu_share=share * len(placement.gpu_ids), gpu_simulated=simulated,
            reason=reason), msg_id=f"{key}:placed")

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

    # ------------------------------------------------------------ preempt, pause, resume

    async def preempt(self, decision: Preempt, now: float) -> bool:
        """Checkpoint-then-stop: the agent sends SIGTERM (m27.train and `checkpoint:` steps
        save on it), SIGKILL after the grace, and reports cause `preempted`."""
        entry = self.table.current(decision.task_id, decision.attempt)
        if entry is None or entry.placement is None or entry.stopping:
            return False
        stop = events.StopTask(at=now, task_id=decision.task_id, attempt=decision.attempt,
                               grace_s=decision.grace_s, reason=decision.reason,
                               cause="preempted")
        # Sent before it is recorded: a crash in between sends it again, with the same
        # message id, which JetStream drops.
        if entry.paused:  # a SIGSTOPped group cannot checkpoint on SIGTERM: continue it
            await self.bus.publish(subjects.node_commands(entry.placement.node_id),
                                   events.ResumeTask(at=now, task_id=decision.task_id,
                                                     attempt=decision.attempt,
                                                     reason="to checkpoint and stop"),
                                   msg_id=f"{decision.task_id}:{decision.attempt}:"
                                          "preempt-resume")
        await self.bus.publish(subjects.node_commands(entry.placement.node_id), stop,
                               msg_id=f"{decision.task_id}:{decision.attempt}:preempt")
        await self.table.store(msgspec.structs.replace(entry, stopping=decision.reason,
                                                       stopping_for=decision.for_task))
        kind = preemption_kind(decision, entry.placement.lender)
        total = self.metrics.preempted(kind)
        # Thrash shows here: the task's own count (this one included) and how many of its
        # latest preemptions in a row found no checkpoint, next to the scheduler's total.
        log.info("task.preempted", task_id=decision.task_id, node_id=entry.placement.node_id,
                 for_task=decision.for_task, kind=kind, grace_s=decision.grace_s,
                 preemptions=entry.task.preemptions + 1,
                 fruitless_preemptions=entry.task.fruitless_preemptions,
                 checkpointed=entry.last_checkpoint_at is not None,
                 preemptions_total=total, reason=decision.reason)
        return True

    async def signal(self, decision: Pause | Resume, now: float) -> bool:
        """SIGSTOP / SIGCONT through the agent; a repeat of the current state is skipped."""
        pause = isinstance(decision, Pause)
        entry = self.table.current(decision.task_id, decision.attempt)
        if (entry is None or entry.placement is None or entry.stopping
                or entry.paused == pause):
            return False
        count = entry.signals + 1
        command: events.PauseTask | events.ResumeTask = (
            events.PauseTask(at=now, task_id=decision.task_id, attempt=decision.attempt,
                             reason=decision.reason) if pause else
            events.ResumeTask(at=now, task_id=decision.task_id, attempt=decision.attempt,
                              reason=decision.reason))
        verb = "pause" if pause else "resume"
        await self.bus.publish(subjects.node_commands(entry.placement.node_id), command,
                               msg_id=f"{decision.task_id}:{decision.attempt}:{verb}:{count}")
        await self.table.store(msgspec.structs.replace(
            entry, paused=pause, signals=count, paused_at=now if pause else None))
        log.info(f"task.{verb}_sent", task_id=decision.task_id,
                 node_id=entry.placement.node_id, reason=decision.reason)
        return True

    # ------------------------------------------------------------ stage, wait

    async def stage(self, decision: Stage, now: float) -> bool:
        """Ready pool: the node's agent reads the task's inputs ahead and answers
        `task_staged`, which adds the node to `staged_nodes` (the policy then prefers
        those nodes). A task that reads nothing is staged at once."""
        entry = self.table.current(decision.task_id)
        node_id = decision.node_id
        if (entry is None or entry.placement is not None
                or node_id in entry.staged_nodes or node_id in entry.staging_nodes):
            return False
        task = entry.task
        if not task.inputs:  # in memory: a restarted scheduler stages it again at once
            self.table.note(msgspec.structs.replace(
                entry, staged_nodes=(*entry.staged_nodes, node_id)))
            log.debug("task.staged", task_id=task.task_id, node_id=decision.node_id,
                      files=0, note="it declares no inputs: nothing to read ahead")
            return True
        await self.bus.publish(subjects.node_commands(decision.node_id), events.StageTask(
            at=now, task_id=task.task_id, run_id=task.run_id, step=task.step,
            attempt=task.attempt, inputs=task.inputs, reason=decision.reason),
            msg_id=f"{task.task_id}:{task.attempt}:stage:{decision.node_id}")
        await self.table.store(msgspec.structs.replace(
            entry, staging_nodes=(*entry.staging_nodes, decision.node_id)))
        log.info("task.stage_sent", task_id=task.task_id, node_id=decision.node_id,
                 inputs=len(task.inputs), reason=decision.reason)
        return True

    async def wait(self, decision: Wait, now: float) -> bool:
        """Counted only when the reason changes (waiting is the usual state); written to
        the bucket the first time and then at most every WAIT_STORE_S."""
        entry = self.table.current(decision.task_id)
        if entry is None or entry.placement is not None or entry.wait_reason == decision.reason:
            return False
        changed = msgspec.structs.replace(entry, wait_reason=decision.reason)
        stored = self.table.stored_at.get(decision.task_id)
        if entry.wait_reason and stored is not None and now - stored < WAIT_STORE_S:
            self.table.note(changed)
            return True
        log.info("task.waiting", task_id=decision.task_id, reason=decision.reason)
        await self.table.store(changed, now)
        return True
