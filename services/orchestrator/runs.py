"""The run state machine (pure): `(stored run, event, now) -> stored run | None`.

A `StoredRun` is what the orchestrator keeps in KV: the run plus an *outbox* of messages its
last changes produced. The shell writes the new StoredRun with compare-and-set, publishes the
outbox (each message with a stable Nats-Msg-Id, so a re-publish after a crash is dropped by
JetStream), then clears it. A crash at any point therefore loses no message and sends none
twice within the deduplication window. `None` means "nothing to change" (duplicates, stale
attempts, events for finished steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import msgspec
from msgspec.structs import replace

from m27.common import events, subjects
from m27.common.ids import task_id
from m27.common.model import (
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    RunRecord,
    RunState,
    StepRecord,
    StepState,
    Urgency,
)
from m27.orchestrator import dag
from m27.orchestrator.pipeline import PipelineSpec

TAIL_IN_RECORD_BYTES: Final = 4096


class Outgoing(msgspec.Struct, frozen=True, kw_only=True):
    """A message to publish once the state that produced it is stored."""

    subject: str
    msg_id: str
    message: events.Message


class StoredRun(msgspec.Struct, frozen=True, kw_only=True):
    run: RunRecord
    outbox: tuple[Outgoing, ...] = ()
    seq: int = 0  # messages ever put in the outbox; gives each a unique id


class _Change:
    """Collects step updates and outgoing messages while one event is applied."""

    def __init__(self, stored: StoredRun, now: float) -> None:
        self.run = stored.run
        self.steps = {s.name: s for s in stored.run.steps}
        self.outbox = list(stored.outbox)
        self.seq = stored.seq
        self.now = now

    def emit(self, subject: str, message: events.Message) -> None:
        self.seq += 1
        self.outbox.append(Outgoing(subject=subject, msg_id=f"{self.run.run_id}:{self.seq}",
                                    message=message))

    def set_step(self, name: str, state: StepState, reason: str = "", **fields: object) -> None:
        step = self.steps[name]
        self.steps[name] = replace(step, state=state, reason=reason or step.reason, **fields)
        self.emit(subjects.step_state(self.run.run_id, name), events.StepStateChanged(
            at=self.now, run_id=self.run.run_id, step=name, state=state, previous=step.state,
            attempt=step.attempt, node_id=self.steps[name].node_id,
            exit_code=self.steps[name].exit_code, reason=reason))

    def set_run(self, state: RunState, reason: str = "", **fields: object) -> None:
        previous = self.run.state
        self.run = replace(self.run, state=state, reason=reason or self.run.reason, **fields)
        self.emit(subjects.run_state(self.run.run_id), events.RunStateChanged(
            at=self.now, run_id=self.run.run_id, state=state, previous=previous,
            reason=reason))

    def result(self) -> StoredRun:
        run = replace(self.run, steps=tuple(self.steps[s.name] for s in self.run.steps))
        return StoredRun(run=run, outbox=tuple(self.outbox), seq=self.seq)


def new_run(spec: PipelineSpec, *, run_id: str, user: str, urgency: Urgency,
            variables: Mapping[str, str], workdir: str, now: float) -> StoredRun:
    """A run of `spec` with its first steps released to the scheduler."""
    steps = tuple(
        StepRecord(name=s.name, type=s.type, command=s.command, depends_on=s.depends_on,
                   output=s.output, checkpoint_interval_s=s.checkpoint_interval_s,
                   resources=s.resources)
        for s in spec.steps
    )
    run = RunRecord(run_id=run_id, name=spec.name, user=user, urgency=urgency, state="queued",
                    created_at=now, steps=steps, workdir=workdir, vars=dict(variables))
    change = _Change(StoredRun(run=run), now)
    change.emit(subjects.run_state(run_id), events.RunSubmitted(
        at=now, run_id=run_id, name=spec.name, user=user, urgency=urgency,
        steps=tuple(s.name for s in steps)))
    _release_ready(change)
    return change.result()


def _release_ready(change: _Change) -> None:
    """Queue every pending step whose dependencies all succeeded."""
    if change.run.cancel_requested:
        return
    for step in list(change.steps.values()):
        if step.state != "pending":
            continue
        if all(change.steps[d].state == "succeeded" for d in step.depends_on):
            attempt = step.attempt + 1
            change.steps[step.name] = replace(step, attempt=attempt)
            change.set_step(step.name, "queued", queued_at=change.now)
            change.emit(subjects.SCHEDULER_COMMANDS, _enqueue(change.run, change.steps[step.name],
                                                               change.now))


def _enqueue(run: RunRecord, step: StepRecord, now: float) -> events.EnqueueTask:
    return events.EnqueueTask(
        at=now, task_id=task_id(run.run_id, step.name), run_id=run.run_id, step=step.name,
        attempt=step.attempt, step_type=step.type, resources=step.resources,
        urgency=run.urgency, user=run.user, command=step.command, workdir=run.workdir,
        checkpoint_interval_s=step.checkpoint_interval_s)


def apply_task_event(stored: StoredRun, event: events.TaskEvent, now: float) -> StoredRun | None:
    """Fold a node or scheduler report about one step into the run."""
    step = stored.run.step(event.step)
    if step is None or event.attempt != step.attempt or step.state in TERMINAL_STEP_STATES:
        return None
    change = _Change(stored, now)
    match event:
        case events.TaskPlaced():
            if step.state != "queued" or step.node_id == event.node_id:
                return None
            change.steps[step.name] = replace(
                step, node_id=event.node_id, gpu_ids=event.gpu_ids,
                gpu_share=event.gpu_share, gpu_simulated=event.gpu_simulated)
        case events.TaskStarted():
            if step.state != "queued":
                return None
            change.set_step(step.name, "running", node_id=event.node_id, started_at=event.at,
                            stdout_path=event.stdout_path, stderr_path=event.stderr_path)
            if change.run.state == "queued":
                change.set_run("running", started_at=event.at)
        case events.TaskExited():
            _finish_step(change, step, event)
    return change.result()


def _finish_step(change: _Change, step: StepRecord, event: events.TaskExited) -> None:
    state: StepState
    if change.run.cancel_requested:
        state, reason = "cancelled", "cancelled: " + (change.run.reason or "on request")
    elif event.exit_code == 0 and event.started:
        state, reason = "succeeded", ""
    else:
        state, reason = "failed", event.reason or f"exit code {event.exit_code}"
    change.set_step(
        step.name, state, reason, node_id=event.node_id or step.node_id,
        exit_code=event.exit_code, ended_at=event.at,
        started_at=step.started_at or event.started_at,
        stdout_tail=event.stdout_tail[-TAIL_IN_RECORD_BYTES:],
        stderr_tail=event.stderr_tail[-TAIL_IN_RECORD_BYTES:],
        stdout_path=event.stdout_path or step.stdout_path,
        stderr_path=event.stderr_path or step.stderr_path)
    if state == "succeeded":
        _release_ready(change)
    else:
        _skip_descendants(change, step.name, state)
    _finish_run_if_done(change)


def _skip_descendants(change: _Change, name: str, why: StepState) -> None:
    graph = {s.name: s.depends_on for s in change.steps.values()}
    for child in _declared_order(change, dag.descendants(graph, name)):
        if change.steps[child].state == "pending":
            change.set_step(child, "skipped", f"upstream step {name} {why}")


def _declared_order(change: _Change, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    return [s.name for s in change.run.steps if s.name in wanted]


def _finish_run_if_done(change: _Change) -> None:
    states = [s.state for s in change.steps.values()]
    if change.run.state in TERMINAL_RUN_STATES:
        return
    if any(state not in TERMINAL_STEP_STATES for state in states):
        return
    if change.run.cancel_requested:
        change.set_run("cancelled", change.run.reason or "cancelled on request",
                       ended_at=change.now)
    elif all(state == "succeeded" for state in states):
        change.set_run("succeeded", ended_at=change.now)
    else:
        failed = [s.name for s in change.steps.values() if s.state == "failed"]
        change.set_run("failed", f"failed step(s): {', '.join(failed)}", ended_at=change.now)


def request_cancel(stored: StoredRun, reason: str, now: float) -> StoredRun | None:
    """Cancel what has not started and ask the scheduler to stop what has."""
    if stored.run.state in TERMINAL_RUN_STATES or stored.run.cancel_requested:
        return None
    change = _Change(stored, now)
    change.run = replace(change.run, cancel_requested=True,
                         reason=reason or "cancelled on request")
    for step in stored.run.steps:
        if step.state in {"queued", "running"}:
            change.emit(subjects.SCHEDULER_COMMANDS, events.CancelTask(
                at=now, task_id=task_id(stored.run.run_id, step.name), attempt=step.attempt,
                reason=change.run.reason))
        if step.state in {"pending", "queued"}:
            change.set_step(step.name, "cancelled", "cancelled before it started",
                            ended_at=now)
    _finish_run_if_done(change)
    return change.result()


def record_report(stored: StoredRun, event: events.ReportReady) -> StoredRun | None:
    if stored.run.report_path == event.path:
        return None
    return replace(stored, run=replace(stored.run, report_path=event.path))


def without_published(stored: StoredRun, msg_ids: Iterable[str]) -> StoredRun:
    """The run with the given outbox messages removed (they are on the bus now)."""
    done = set(msg_ids)
    return replace(stored, outbox=tuple(o for o in stored.outbox if o.msg_id not in done))
