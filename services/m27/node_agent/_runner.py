"""Runs steps on this node: start, watch, stop, and report each one on the bus.

Every task's life ends in exactly one TaskExited: when its main process exits (what is left
of its process group is then SIGKILLed, as Slurm ends a job step), when it cannot be
started, or — after an agent crash — when the next agent finds it in the ledger.
Events carry `msg_id`s (`<task>:<attempt>:started|exited`), so publishing one twice is a
no-op for JetStream and every publish can simply be retried.

This is the tasks' life cycle; its concerns live beside it: the ledger (`_ledger.Ledger`),
program-managed checkpoint files (`_file_sync.FileSync`), CPU and memory confinement
(`_isolation.confine`), and what a start or an end means (`_tasks`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec
import nats.errors

from m27.common import subjects
from m27.common.bus import Bus, PoisonMessage
from m27.common.errors import Unavailable
from m27.common.events import (
    MetricPoint,
    MetricPoints,
    SecretsReply,
    SecretsRequest,
    StartTask,
    StopTask,
    TaskExited,
    TaskStarted,
)
from m27.common.logging import bound_contextvars, get_logger
from m27.common.model import NO_CHECKPOINT_SIGNAL, Fence, TaskHolding
from m27.node_agent._anomalies import EVENTS_PER_MINUTE, TrainingWatch, anomaly_msg_id
from m27.node_agent._file_sync import FileCheckpoints, FileSync
from m27.node_agent._gpus import Holding
from m27.node_agent._isolation import Cgroups, confine, remove_cgroup
from m27.node_agent._ledger import Ledger, LedgerTask, reap_orphan
from m27.node_agent._metric_files import POLL_S as METRICS_POLL_S
from m27.node_agent._metric_files import READ_BYTES, MetricsFile
from m27.node_agent._process import (
    missing_outputs,
    output_written,
    read_tail,
    signal_by_name,
    signal_group,
    spawn,
    wait_group,
)
from m27.node_agent._tasks import (
    STDERR_TAIL_BYTES,
    STDOUT_TAIL_BYTES,
    CannotStart,
    Ending,
    NodeContext,
    StopRequest,
    TaskPaths,
    ending,
    invalid_ids,
    node_stopping,
    not_started_exit,
    placement_problem,
    shell_command,
    stop_requested,
    superseded_by,
    task_env,
    task_paths,
    timed_out,
    timeout_of,
)
from m27.node_agent._telemetry import RunningView

log = get_logger()

RETRY_MAX_DELAY_S: Final = 5.0
#: Checking declared outputs is a few stat() calls; a dead network mount must not keep the
#: exit unreported forever (unchecked outputs then count as missing).
OUTPUTS_CHECK_TIMEOUT_S: Final = 30.0
#: How long a start waits for the orchestrator to hand over a step's secret values (the
#: node's commands wait meanwhile); with no answer the start is retried later.
SECRETS_TIMEOUT_S: Final = 3.0
TaskKey = tuple[str, int]


class NotLeased(Unavailable):
    """The node's lease lapsed: start nothing until it is renewed (the message comes back)."""


class AgentStopping(Unavailable):
    """A StartTask arrived while the agent shuts down; it is redelivered to the next agent."""


@dataclass(eq=False)
class RunningTask:
    """A started task, from spawn until its TaskExited is stored."""

    cmd: StartTask
    paths: TaskPaths
    process: asyncio.subprocess.Process
    started_at: float
    started_published: bool = False
    paused: bool = False
    cgroup: Path | None = None
    checkpoint_store: str | None = None  # the checkpoint-store's address at start, if any
    stop: StopRequest | None = None  # the first reason the agent stopped it, if it did
    stop_deadline: float | None = None  # (event-loop time) when its grace period ends
    stop_grace_s: float = 0.0
    killed_after_s: float | None = None
    publish_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    watcher: asyncio.Task[None] | None = None
    escalations: list[asyncio.Task[None]] = field(default_factory=list)
    metrics: MetricsFile | None = None
    metrics_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    training: TrainingWatch | None = None  # the step's `monitor:`, if it has one

    @property
    def key(self) -> TaskKey:
        return (self.cmd.task_id, self.cmd.attempt)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


def _msg_id(cmd: StartTask, what: str) -> str:
    return f"{cmd.task_id}:{cmd.attempt}:{what}"


class TaskRunner:
    """The node's tasks. Handlers call `start`/`stop`; the agent reads `holdings`."""

    def __init__(self, bus: Bus, node: NodeContext, *, stop_grace_s: float,
                 environ: Mapping[str, str],
                 clock: Callable[[], float] = time.time,
                 leased: Callable[[], bool] = lambda: True,
                 cgroups: Cgroups | None = None,
                 energy: Callable[[str, int], float | None] = lambda _t, _a: None,
                 files: FileCheckpoints | None = None) -> None:
        self._bus = bus
        self._files = FileSync(bus, files or FileCheckpoints(), clock)
        self._leased = leased
        self._energy = energy
        self._cgroups = cgroups or Cgroups(None, "not checked")
        self._node = node
        self._sender = subjects.node_sender(node.node_id)
        self._stop_grace_s = stop_grace_s
        self._environ = dict(environ)
        self._clock = clock
        self._tasks: dict[TaskKey, RunningTask] = {}
        self._protecting: set[asyncio.Task[None]] = set()
        self._ledger = Ledger(node.home, node.node_id)
        self.accepting = True

    # ------------------------------------------------------------ what runs here

    def holdings(self) -> list[Holding]:
        return [Holding(gpu_ids=t.cmd.gpu_ids, gpu_share=t.cmd.gpu_share)
                for t in self._tasks.values() if t.alive]

    def running_ids(self) -> tuple[str, ...]:
        return tuple(sorted({t.cmd.task_id for t in self._tasks.values() if t.alive}))

    def task_holdings(self) -> tuple[TaskHolding, ...]:
        """What each running task holds, as the node reports it with every renewal."""
        return tuple(TaskHolding(task_id=t.cmd.task_id, attempt=t.cmd.attempt,
                                 gpu_ids=t.cmd.gpu_ids, gpu_share=t.cmd.gpu_share,
                                 paused=t.paused)
                     for t in self._tasks.values() if t.alive)

    def views(self) -> tuple[RunningView, ...]:
        """What telemetry samples: each running task with its process group."""
        return tuple(RunningView(task_id=t.cmd.task_id, run_id=t.cmd.run_id, step=t.cmd.step,
                                 attempt=t.cmd.attempt, gpu_ids=t.cmd.gpu_ids,
                                 gpu_share=t.cmd.gpu_share, gpu_memory_mb=t.cmd.gpu_memory_mb,
                                 pgid=t.process.pid, paused=t.paused,
                                 phase_file=str(t.paths.phase_file))
                     for t in self._tasks.values() if t.alive)

    def stop_over_share(self, task_id: str, attempt: int, note: str) -> None:
        """The over-share policy's stop: like a StopTask, reported with cause over_share."""
        task = self._tasks.get((task_id, attempt))
        if task is not None and task.alive:
            self._terminate(task, StopRequest("over_share", note), self._stop_grace_s)

    @property
    def ledger_path(self) -> Path:
        return self._ledger.path

    # ------------------------------------------------------------ StartTask

    async def start(self, cmd: StartTask) -> None:
        """Run the task once per (task_id, attempt); return once TaskStarted is stored."""
        problem = invalid_ids(cmd)
        if problem:
            raise PoisonMessage(f"StartTask {cmd.task_id!r}: {problem}")
        if not self.accepting:
            raise AgentStopping(f"node agent stopping; {cmd.task_id} left for redelivery")
        with bound_contextvars(task_id=cmd.task_id, run_id=cmd.run_id, attempt=cmd.attempt):
            latest = self._ledger.latest(cmd.task_id)
            if latest is not None and cmd.attempt <= latest:
                await self._on_duplicate(cmd, latest)
                return
            if not self._leased():
                raise NotLeased(f"the node's lease has lapsed; {cmd.task_id} is left for "
                                "redelivery once it is renewed")
            fence = await self._fence(cmd.task_id)
            if fence is None or (fence.attempt, fence.node_id) != (cmd.attempt,
                                                                     self._node.node_id):
                log.warning("task.stale_assignment", fence_attempt=fence and fence.attempt,
                            fence_node=fence and fence.node_id)
                return  # not this node's to run (any more): the message is dropped
            self._supersede(cmd)
            paths = task_paths(self._node.home, cmd)
            try:
                task = await self._launch(cmd, paths)
            except CannotStart as exc:
                await self._report_not_started(cmd, paths, str(exc))
                return
            await self._ensure_started_published(task)

    async def _fence(self, task_id: str) -> Fence | None:
        """The task's fencing token: which attempt may run it, and where."""
        got = await self._bus.kv_get(subjects.FENCES_BUCKET, subjects.task_key(task_id), Fence)
        return got[0] if got else None

    def fence_all(self, note: str) -> int:
        """Self-fencing: SIGKILL every task now (the lease lapsed; they may restart
        elsewhere soon). Returns how many were running."""
        alive = [t for t in self._tasks.values() if t.alive]
        for task in alive:
            self._terminate(task, StopRequest("fenced", note), 0.0)
        return len(alive)

    async def kill_stale(self) -> int:
        """Kill tasks whose attempt is no longer the assigned one (the node was declared
        lost and they run elsewhere now): only one attempt of a task ever runs."""
        killed = 0
        for task in [t for t in self._tasks.values() if t.alive]:
            fence = await self._fence(task.cmd.task_id)
            if fence is None or (fence.attempt, fence.node_id) == (task.cmd.attempt,
                                                                     self._node.node_id):
                continue
            self._terminate(task, StopRequest(
                "fenced", f"attempt {task.cmd.attempt} is stale: attempt {fence.attempt} is "
                f"assigned to {fence.node_id}"), 0.0)
            killed += 1
        return killed

    async def _on_duplicate(self, cmd: StartTask, latest: int) -> None:
        task = self._tasks.get((cmd.task_id, cmd.attempt))
        if task is not None:
            await self._ensure_started_published(task)  # the first try may not have made it
        log.info("task.duplicate_ignored", latest_attempt=latest,
                 running=task is not None and task.alive)

    def _supersede(self, cmd: StartTask) -> None:
        """A newer attempt of a task still running here replaces the older one."""
        for task in list(self._tasks.values()):
            if task.cmd.task_id == cmd.task_id and task.alive:
                self._terminate(task, superseded_by(cmd.attempt), self._stop_grace_s)

    async def _launch(self, cmd: StartTask, paths: TaskPaths) -> RunningTask:
        problem = placement_problem(cmd, self._node.gpus)
        if problem:
            raise CannotStart(problem)
        try:
            if paths.default_workdir:
                paths.workdir.mkdir(parents=True, exist_ok=True)
            paths.phase_file.parent.mkdir(parents=True, exist_ok=True)
            paths.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            paths.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            store = await self._files.store_address()
            if store and cmd.checkpoint_interval_s:  # only such steps' files are uploaded
                await self._files.restore(cmd, paths.checkpoint_dir, store)
            node = dataclasses.replace(self._node, checkpoint_store=store)
            secrets = await self._secrets(cmd)
            env = task_env(self._environ, cmd, node, paths, secrets)
            process = await spawn(shell_command(cmd), cwd=paths.workdir, env=env,
                                  stdout=paths.stdout, stderr=paths.stderr,
                                  mask=tuple(secrets.values()))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise CannotStart(str(exc)) from exc
        task = RunningTask(cmd=cmd, paths=paths, process=process, started_at=self._clock(),
                           checkpoint_store=store)
        task.cgroup = confine(self._cgroups, cmd.task_id, cmd.attempt, process.pid, cmd.cpus,
                              cmd.memory_mb)
        self._tasks[task.key] = task
        self._ledger.remember(cmd.task_id, cmd.attempt)
        self._save_ledger()
        task.watcher = asyncio.create_task(self._watch(task), name=f"watch {cmd.task_id}")
        task.metrics = MetricsFile(paths.metrics_file)
        if cmd.monitor:
            task.training = TrainingWatch(cmd, self._node.node_id)
        task.escalations.append(asyncio.create_task(self._tail_metrics(task)))
        if cmd.checkpoint_interval_s:
            task.escalations.append(asyncio.create_task(
                self._checkpoint_every(task, cmd.checkpoint_interval_s)))
        timeout_s = timeout_of(cmd)
        if timeout_s is not None:  # cancelled with the escalations when the task exits
            task.escalations.append(asyncio.create_task(self._time_out(task, timeout_s)))
        log.info("task.started", pid=process.pid, step=cmd.step, workdir=str(paths.workdir),
                 gpu_ids=list(cmd.gpu_ids), gpu_share=cmd.gpu_share,
                 gpu_backend=self._node.backend if cmd.gpu_ids else "none",
                 command_chars=len(cmd.command))  # not its text: it holds the --var values
        return task

    async def _secrets(self, cmd: StartTask) -> dict[str, str]:
        """The step's secret environment values: the orchestrator gives them to the node
        the attempt is assigned to, on its own reply subject (`orchestrator.secrets`).
        Unavailable (the command is redelivered) while nobody answers."""
        if not cmd.secrets:
            return {}
        request = SecretsRequest(task_id=cmd.task_id, attempt=cmd.attempt, key=cmd.secrets)
        try:
            data = await self._bus.request(subjects.SECRETS_REQUEST,
                                           msgspec.json.encode(request), SECRETS_TIMEOUT_S)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise Unavailable(f"no orchestrator answered for {cmd.task_id}'s secret "
                              "values; the start is retried") from exc
        try:
            reply = msgspec.json.decode(data, type=SecretsReply)
        except msgspec.DecodeError as exc:
            raise Unavailable(f"unreadable answer for {cmd.task_id}'s secret values: "
                              f"{exc}") from None
        if reply.error and reply.transient:
            raise Unavailable(reply.error)
        if reply.error:
            raise CannotStart(f"no secret values: {reply.error}")
        return dict(reply.env)

    async def _report_not_started(self, cmd: StartTask, paths: TaskPaths, why: str) -> None:
        """TaskExited(started=False); the attempt counts as seen only once that is stored."""
        event = not_started_exit(cmd, self._node.node_id, paths, why, self._clock())
        log.warning("task.not_started", reason=event.reason)
        await self._bus.publish(subjects.task_events(cmd.run_id, cmd.step, self._sender), event,
                                msg_id=_msg_id(cmd, "exited"))
        self._ledger.remember(cmd.task_id, cmd.attempt)
        self._save_ledger()

    async def _ensure_started_published(self, task: RunningTask) -> None:
        async with task.publish_lock:
            if task.started_published:
                return
            cmd = task.cmd
            event = TaskStarted(
                at=task.started_at, task_id=cmd.task_id, run_id=cmd.run_id, step=cmd.step,
                attempt=cmd.attempt, node_id=self._node.node_id, pid=task.process.pid,
                stdout_path=str(task.paths.stdout), stderr_path=str(task.paths.stderr),
            )
            await self._bus.publish(subjects.task_events(cmd.run_id, cmd.step, self._sender), event,
                                    msg_id=_msg_id(cmd, "started"))
            task.started_published = True

    # ------------------------------------------------------------ exit

    async def _watch(self, task: RunningTask) -> None:
        cmd = task.cmd
        with bound_contextvars(task_id=cmd.task_id, run_id=cmd.run_id, attempt=cmd.attempt):
            try:
                await self._report_exit(task)
            except Exception as exc:  # a bug here must at least be visible
                log.exception("task.watch_failed", error=str(exc))

    async def _report_exit(self, task: RunningTask) -> None:
        returncode = await task.process.wait()
        # Stopped with a grace period: the shell may be gone while the program it ran is
        # still writing its checkpoint. The grace period is for the whole group.
        if task.stop_deadline is not None and \
                not await wait_group(task.process.pid, task.stop_deadline):
            task.killed_after_s = task.stop_grace_s
        group_left = signal_group(task.process.pid, signal.SIGKILL)
        if not await output_written(task.process.pid):
            log.warning("task.output_still_open", note="a process that left the step's group "
                        "still holds its output; the tails may miss the last lines")
        for escalation in task.escalations:  # the timeout too: it must not fire any more
            escalation.cancel()
        # the rest of its metrics before its exit, so a finished step's series is whole
        await self._retrying("metrics", lambda: self._drain_metrics(task))
        if task.stop is None and not self._leased():
            # Killed by the node's guard while the lease had lapsed (the agent was frozen).
            task.stop = StopRequest("fenced", "the node's lease lapsed: fenced by its guard")
        end = ending(returncode, task.stop, task.killed_after_s)
        if returncode != 0:  # the next attempt, wherever it runs, resumes from these
            await self._upload_files(task, "exit")
        missing = await self._missing_outputs(task) if end.check_outputs else ()
        event = self._exited_event(task, end, missing)
        log.info("task.exited", exit_code=event.exit_code, signal=event.signal,
                 cause=event.cause, reason=event.reason, group_killed=group_left,
                 missing_outputs=list(event.missing_outputs),
                 duration_s=round(event.at - task.started_at, 3))
        await self._retrying("task exit", lambda: self._publish_exit(task, event))
        remove_cgroup(task.cgroup)
        self._tasks.pop(task.key, None)
        self._save_ledger()

    async def _missing_outputs(self, task: RunningTask) -> tuple[str, ...]:
        """Checked off the event loop and bounded: a stat() can hang on a dead mount."""
        outputs = task.cmd.outputs
        if not outputs:
            return ()
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(missing_outputs, task.paths.workdir, outputs),
                OUTPUTS_CHECK_TIMEOUT_S)
        except TimeoutError:
            log.error("task.outputs_check_timed_out", timeout_s=OUTPUTS_CHECK_TIMEOUT_S,
                      workdir=str(task.paths.workdir))
            return tuple(outputs)

    def _exited_event(self, task: RunningTask, end: Ending,
                      missing: tuple[str, ...]) -> TaskExited:
        cmd = task.cmd
        return TaskExited(
            at=self._clock(), task_id=cmd.task_id, run_id=cmd.run_id, step=cmd.step,
            attempt=cmd.attempt, node_id=self._node.node_id, exit_code=end.exit_code,
            signal=end.signal, started=True, started_at=task.started_at,
            stdout_tail=read_tail(task.paths.stdout, STDOUT_TAIL_BYTES),
            stderr_tail=read_tail(task.paths.stderr, STDERR_TAIL_BYTES),
            stdout_path=str(task.paths.stdout), stderr_path=str(task.paths.stderr),
            reason=end.reason, cause=end.cause, missing_outputs=missing,
            energy_j=self._energy(cmd.task_id, cmd.attempt),
        )

    async def _publish_exit(self, task: RunningTask, event: TaskExited) -> None:
        await self._ensure_started_published(task)  # started always precedes exited
        await self._bus.publish(subjects.task_events(event.run_id, event.step, self._sender), event,
                                msg_id=_msg_id(task.cmd, "exited"))

    async def _retrying(self, what: str, action: Callable[[], Awaitable[None]]) -> None:
        """Until it succeeds: an exit must reach the bus, or its GPUs stay booked forever."""
        delay = 0.2
        while True:
            try:
                await action()
                return
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("bus.publish_retry", what=what, error=str(exc) or type(exc).__name__,
                            retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_DELAY_S)

    # ------------------------------------------------------------ metrics

    async def _tail_metrics(self, task: RunningTask) -> None:
        """What the step appends to its metrics file, onto the bus every POLL_S."""
        while task.alive:
            await asyncio.sleep(METRICS_POLL_S)
            try:
                await self._publish_metrics(task)
            except (TimeoutError, nats.errors.Error, OSError) as exc:  # read again next time
                log.warning("metrics.publish_failed", error=str(exc) or type(exc).__name__)

    async def _drain_metrics(self, task: RunningTask) -> None:
        """The rest of an ended step's metrics; a file it cannot read (the step took its
        permissions away, a failing disk) never holds up the step's exit."""
        try:
            await self._publish_metrics(task, reads=16)
        except OSError as exc:
            log.warning("metrics.unreadable", error=str(exc))

    async def _publish_metrics(self, task: RunningTask, reads: int = 4) -> None:
        """At most `reads` × READ_BYTES of what is new in the file: a step that writes
        faster than that per poll (16 MiB per 0.5 s) falls behind, and at its end what
        lies beyond 64 MiB more is left unpublished (said in the agent's log)."""
        tail = task.metrics
        if tail is None:
            return
        cmd = task.cmd
        async with task.metrics_lock:
            for _ in range(reads):
                had_problem, start = bool(tail.first_problem), tail.offset
                chunks, end = await asyncio.to_thread(tail.read, self._clock(), READ_BYTES)
                if tail.first_problem and not had_problem:
                    log.warning("metrics.lines_skipped", file=str(tail.path),
                                first=tail.first_problem)
                for chunk in chunks:
                    try:
                        await self._bus.publish(
                            subjects.metrics(cmd.run_id, cmd.step, self._sender), MetricPoints(
                                at=self._clock(), task_id=cmd.task_id, run_id=cmd.run_id,
                                step=cmd.step, attempt=cmd.attempt,
                                node_id=self._node.node_id, offset=chunk.offset,
                                points=tuple(chunk.points)),
                            msg_id=f"{cmd.task_id}:{cmd.attempt}:metrics:{chunk.offset}")
                    except nats.errors.MaxPayloadError:  # cannot happen below BATCH_BYTES
                        log.warning("metrics.batch_too_big", offset=chunk.offset,
                                    points=len(chunk.points))
                    self._watch_training(task, chunk.offset, chunk.points, tail.truncations)
                tail.offset = end
                if end - start < READ_BYTES // 2:
                    break  # caught up; a read near the limit means more may be waiting
            else:
                if not task.alive:
                    log.warning("metrics.left_unread", file=str(tail.path), offset=tail.offset)
            await self._publish_anomalies(task)

    def _watch_training(self, task: RunningTask, offset: int,
                        points: Sequence[MetricPoint], truncations: int) -> None:
        """The step's training monitor on points just read: on an anomaly the step is
        asked to checkpoint at once and/or stopped, as its `monitor:` says."""
        if task.training is None:
            return
        suppressed = task.training.suppressed
        for anomaly in task.training.feed(offset, points, self._clock(), truncations):
            log.warning("task.training_anomaly", task_id=task.cmd.task_id, kind=anomaly.kind,
                        metric=anomaly.metric, train_step=anomaly.train_step,
                        detail=anomaly.detail, actions=list(anomaly.actions))
            note = f"training anomaly: {anomaly.detail}"
            if "checkpoint" in anomaly.actions and task.training.may_act(self._clock()):
                self.request_checkpoint(task.cmd.task_id, task.cmd.attempt, note)
                point_at = next((p.at for p in points if p.step == anomaly.train_step),
                                anomaly.at)
                # not one of the task's escalations: it must finish if the task ends now
                protecting = asyncio.create_task(self._files.protect(
                    task.cmd, task.checkpoint_store, anomaly.train_step, point_at, note))
                self._protecting.add(protecting)
                protecting.add_done_callback(self._protecting.discard)
            if "stop" in anomaly.actions and task.alive and task.stop is None:
                self._terminate(task, StopRequest("anomaly", note), self._stop_grace_s)
        if task.training.suppressed > suppressed:
            log.warning("task.training_anomalies_suppressed", task_id=task.cmd.task_id,
                        suppressed=task.training.suppressed,
                        why=f"more than {EVENTS_PER_MINUTE} a minute")

    async def _publish_anomalies(self, task: RunningTask) -> None:
        """The `training_anomaly` events found so far; one that cannot be published yet
        waits for the next read."""
        outbox = task.training.outbox if task.training else None
        while outbox:
            await self._bus.publish(
                subjects.task_events(task.cmd.run_id, task.cmd.step, self._sender), outbox[0],
                msg_id=anomaly_msg_id(outbox[0]))
            outbox.popleft()

    # ------------------------------------------------------------ StopTask and shutdown

    async def _checkpoint_every(self, task: RunningTask, interval_s: float) -> None:
        """The step's `checkpoint:` interval, delivered as periodic checkpoint requests."""
        while task.alive:
            await asyncio.sleep(interval_s)
            if task.alive:  # what the last request produced is complete by now: keep it
                await self._upload_files(task, "interval")
            if task.alive:
                self.request_checkpoint(task.cmd.task_id, task.cmd.attempt, "interval")

    def request_checkpoint(self, task_id: str, attempt: int, reason: str) -> bool:
        """Send the task its checkpoint signal (the step's `checkpoint_signal`)."""
        task = self._tasks.get((task_id, attempt))
        if task is None or not task.alive:
            log.info("task.checkpoint_ignored", task_id=task_id, attempt=attempt,
                     why="not running here")
            return False
        if task.cmd.checkpoint_signal == NO_CHECKPOINT_SIGNAL:
            log.info("task.checkpoint_not_signalled", task_id=task_id, reason=reason,
                     why="checkpoint_signal: none (the program checkpoints on its own)")
            return False
        sig = signal_by_name(task.cmd.checkpoint_signal)
        if task.paused:
            return False  # a stopped process cannot act on it; asked again after resume
        sent = signal_group(task.process.pid, sig)
        log.info("task.checkpoint_requested", task_id=task_id, signal=sig.name, reason=reason,
                 sent=sent)
        return sent

    def pause(self, task_id: str, attempt: int, reason: str) -> bool:
        """SIGSTOP the whole group: the task keeps its memory but uses no CPU or GPU time."""
        return self._set_paused(task_id, attempt, True, reason)

    def resume(self, task_id: str, attempt: int, reason: str) -> bool:
        return self._set_paused(task_id, attempt, False, reason)

    def _set_paused(self, task_id: str, attempt: int, paused: bool, reason: str) -> bool:
        task = self._tasks.get((task_id, attempt))
        if task is None or not task.alive or task.paused == paused:
            return False
        sent = signal_group(task.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
        task.paused = paused and sent
        log.info("task.paused" if paused else "task.resumed", task_id=task_id, reason=reason,
                 sent=sent)
        return sent

    def stop(self, cmd: StopTask) -> None:
        """SIGTERM the task's process group now, SIGKILL it after `grace_s`."""
        with bound_contextvars(task_id=cmd.task_id, attempt=cmd.attempt):
            task = self._tasks.get((cmd.task_id, cmd.attempt))
            if task is None or not task.alive:
                log.info("task.stop_ignored", reason=cmd.reason,
                         why="finished" if task else "not running here")
                return
            self._terminate(task, stop_requested(cmd.reason, cmd.cause), cmd.grace_s)

    def _terminate(self, task: RunningTask, why: StopRequest, grace_s: float) -> None:
        """SIGTERM the group now, SIGKILL it after `grace_s`; the first `why` is reported."""
        if task.stop is None:
            task.stop = why
            task.stop_deadline = asyncio.get_running_loop().time() + grace_s
            task.stop_grace_s = grace_s
        signalled = signal_group(task.process.pid, signal.SIGTERM)
        if task.paused:  # SIGSTOPped, it would only see the SIGKILL at the end of the grace
            task.paused = not signal_group(task.process.pid, signal.SIGCONT)
        log.info("task.stopping", task_id=task.cmd.task_id, pid=task.process.pid,
                 reason=why.note, cause=why.cause, grace_s=grace_s, signalled=signalled)
        task.escalations.append(asyncio.create_task(self._escalate(task, grace_s)))

    async def _escalate(self, task: RunningTask, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if task.alive:
            task.killed_after_s = grace_s
            signal_group(task.process.pid, signal.SIGKILL)
            log.warning("task.killed_after_grace", task_id=task.cmd.task_id, grace_s=grace_s)

    async def _time_out(self, task: RunningTask, timeout_s: float) -> None:
        """The step's `timeout:`: stopped like a StopTask, reported with cause timeout.

        A task already being stopped (StopTask, superseded, shutdown) is left to that stop:
        its cause and its grace stay as they are.
        """
        await asyncio.sleep(timeout_s)
        if task.alive and task.stop is None:
            log.warning("task.timed_out", task_id=task.cmd.task_id, timeout_s=timeout_s)
            self._terminate(task, timed_out(timeout_s), self._stop_grace_s)

    async def stop_all(self, note: str, grace_s: float, report_timeout_s: float) -> int:
        """Stop every task and wait (bounded) until their exits are reported."""
        self.accepting = False
        tasks = list(self._tasks.values())
        for task in tasks:
            if task.alive:
                self._terminate(task, node_stopping(note), grace_s)
        watchers = [t.watcher for t in tasks if t.watcher is not None]
        if watchers:
            _done, pending = await asyncio.wait(watchers, timeout=grace_s + report_timeout_s)
            for watcher in pending:
                watcher.cancel()
            if pending:
                log.error("tasks.exit_unreported", count=len(pending))
        return len(tasks)

    # ------------------------------------------------------------ the ledger and files

    async def _upload_files(self, task: RunningTask, why: str) -> None:
        await self._files.upload(task.cmd, task.paths.checkpoint_dir, task.checkpoint_store,
                                 why)

    def _save_ledger(self) -> None:
        self._ledger.save(
            LedgerTask(task_id=t.cmd.task_id, run_id=t.cmd.run_id, step=t.cmd.step,
                       attempt=t.cmd.attempt, pid=t.process.pid, started_at=t.started_at,
                       stdout_path=str(t.paths.stdout), stderr_path=str(t.paths.stderr))
            for t in self._tasks.values())

    async def recover(self) -> None:
        """Load the ledger; kill and report the tasks an earlier agent left running."""
        left: list[LedgerTask] = []
        for entry in self._ledger.load():
            try:
                await reap_orphan(entry, self._node.node_id, self._clock(), self._bus)
            except (TimeoutError, nats.errors.Error) as exc:
                log.error("task.orphan_unreported", task_id=entry.task_id, error=str(exc))
                left.append(entry)
        self._ledger.save(left)
