"""The run state machine (pure): `(stored run, event, now) -> stored run | None`.

A `StoredRun` is what the orchestrator keeps in KV: the run plus an *outbox* of messages its
last changes produced. The shell writes the new StoredRun with compare-and-set, publishes the
outbox (each message with a stable Nats-Msg-Id, so a re-publish after a crash is dropped by
JetStream), then clears it. A crash at any point therefore loses no message and sends none
twice within the deduplication window. `None` means "nothing to change" (duplicates, stale
attempts, events for finished steps).

Step life: pending → queued (dependencies succeeded; `cache_pending` while the cache is
looked up) → running → succeeded | failed, or → retrying → running again; cancelled and
skipped end a step that will not run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Final

import msgspec
from msgspec.structs import replace

from m27.common import events, subjects
from m27.common.ids import task_id
from m27.common.model import (
    INFRASTRUCTURE_CAUSES,
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    AttemptRecord,
    RunRecord,
    RunState,
    StepRecord,
    StepState,
)
from m27.pipeline import PipelineSpec, dag

TAIL_IN_RECORD_BYTES: Final = 4096
ACTIVE_STATES: Final = frozenset({"queued", "running", "retrying"})


class Outgoing(msgspec.Struct, frozen=True, kw_only=True):
    """A message to publish once the state that produced it is stored."""

    subject: str
    msg_id: str
    message: events.Message


class StoredRun(msgspec.Struct, frozen=True, kw_only=True):
    run: RunRecord
    outbox: tuple[Outgoing, ...] = ()
    seq: int = 0  # messages ever put in the outbox; gives each a unique id


class CacheHit(msgspec.Struct, frozen=True, kw_only=True):
    """Results of an identical earlier step that can stand in for running this one."""

    task_id: str  # `<run_id>/<step>` that produced them
    outputs: tuple[str, ...] = ()


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    delay_s: float
    infrastructure: bool
    count: int  # this is retry number `count` of its kind
    limit: int


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

    def update(self, name: str, **fields: object) -> StepRecord:
        self.steps[name] = replace(self.steps[name], **fields)
        return self.steps[name]

    def set_step(self, name: str, state: StepState, reason: str = "", **fields: object) -> None:
        previous = self.steps[name].state
        step = self.update(name, state=state, reason=reason, **fields)
        self.emit(subjects.step_state(self.run.run_id, name), events.StepStateChanged(
            at=self.now, run_id=self.run.run_id, step=name, state=state, previous=previous,
            attempt=step.attempt, node_id=step.node_id, exit_code=step.exit_code,
            reason=reason))

    def set_run(self, state: RunState, reason: str = "", **fields: object) -> None:
        previous = self.run.state
        self.run = replace(self.run, state=state, reason=reason, **fields)
        self.emit(subjects.run_state(self.run.run_id), events.RunStateChanged(
            at=self.now, run_id=self.run.run_id, state=state, previous=previous,
            reason=reason))

    def graph(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.depends_on for s in self.steps.values()}

    def result(self) -> StoredRun:
        run = replace(self.run, steps=tuple(self.steps[s.name] for s in self.run.steps))
        return StoredRun(run=run, outbox=tuple(self.outbox), seq=self.seq)


def new_run(spec: PipelineSpec, *, run_id: str, user: str, variables: Mapping[str, str],
            workdir: str, now: float, use_cache: bool = True, source_name: str = "",
            secret_keys: tuple[str, ...] = ()) -> StoredRun:
    """A run of `spec` with its first steps released; `secret_keys` name where each of
    `spec.secret_sets` is stored."""
    if len(secret_keys) != len(spec.secret_sets):
        raise ValueError(f"{len(spec.secret_sets)} secret sets, {len(secret_keys)} keys")
    run = RunRecord(run_id=run_id, name=spec.name, user=user, urgency=spec.urgency,
                    state="queued", created_at=now, steps=spec.steps, workdir=workdir,
                    vars=dict(variables), max_parallel=dict(spec.max_parallel),
                    use_cache=use_cache, source_name=source_name, secret_keys=secret_keys)
    change = _Change(StoredRun(run=run), now)
    change.emit(subjects.run_state(run_id), events.RunSubmitted(
        at=now, run_id=run_id, name=spec.name, user=user, urgency=spec.urgency,
        steps=tuple(s.name for s in spec.steps)))
    _release_ready(change)
    return change.result()


def _release_ready(change: _Change) -> None:
    """Queue every pending step whose dependencies all succeeded, within sweep caps."""
    if change.run.cancel_requested:
        return
    active: dict[str, int] = {}
    for step in change.steps.values():
        if step.group and step.state in ACTIVE_STATES:
            active[step.group] = active.get(step.group, 0) + 1
    for step in list(change.steps.values()):
        if step.state != "pending" or any(change.steps[d].state != "succeeded"
                                          for d in step.depends_on):
            continue
        cap = change.run.max_parallel.get(step.group) if step.group else None
        if cap is not None and active.get(step.group, 0) >= cap:
            continue
        if step.group:
            active[step.group] = active.get(step.group, 0) + 1
        _queue(change, step.name)


def _queue(change: _Change, name: str) -> None:
    step = change.update(name, attempt=change.steps[name].attempt + 1)
    lookup = change.run.use_cache
    change.set_step(name, "queued", "looking for reusable results" if lookup else "",
                    queued_at=change.now, cache_pending=lookup)
    if not lookup:
        change.emit(subjects.SCHEDULER_COMMANDS, _enqueue(change.run, step, change.now))


def step_workdir(run: RunRecord, step: StepRecord) -> str:
    """Where the step runs: its own `workdir:` (relative to the run's), else the run's."""
    if not step.workdir:
        return run.workdir
    if PurePosixPath(step.workdir).is_absolute() or not run.workdir:
        return step.workdir
    return str(PurePosixPath(run.workdir) / step.workdir)


def absolute(run: RunRecord, step: StepRecord, path: str) -> str:
    """A declared path as the step sees it, made absolute."""
    if os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(step_workdir(run, step), path))


def paths_read(run: RunRecord, step: StepRecord) -> tuple[str, ...]:
    """What the step reads: its `inputs:` and the `outputs:` of the steps it depends on
    (the ready pool stages them), each once, absolute."""
    paths = [absolute(run, step, p) for p in step.inputs]
    for name in step.depends_on:
        dep = run.step(name)
        if dep is not None:
            paths += [absolute(run, dep, p) for p in dep.outputs]
    return tuple(dict.fromkeys(paths))


def _enqueue(run: RunRecord, step: StepRecord, now: float,
             not_before: float = 0.0) -> events.EnqueueTask:
    return events.EnqueueTask(
        at=now, task_id=task_id(run.run_id, step.name), run_id=run.run_id, step=step.name,
        attempt=step.attempt, step_type=step.type, resources=step.resources,
        urgency=step.urgency, user=run.user, command=step.command,
        workdir=step_workdir(run, step), env=dict(step.env),
        secrets=run.secret_keys[step.secret_set] if step.secret_set >= 0 else "",
        checkpoint_interval_s=step.checkpoint_interval_s, timeout_s=step.timeout_s,
        outputs=step.outputs, preemptible=step.preemptible, not_before=not_before,
        checkpoint_signal=step.checkpoint_signal, monitor=step.monitor,
        inputs=paths_read(run, step),
        preemptions=step.preemptions, fruitless_preemptions=step.fruitless_preemptions)


def resolve_cache(stored: StoredRun, name: str, key: str, hit: CacheHit | None,
                  now: float) -> StoredRun | None:
    """The cache lookup for a released step came back: reuse the results, or run it."""
    step = stored.run.step(name)
    if step is None or step.state != "queued" or not step.cache_pending:
        return None
    change = _Change(stored, now)
    if hit is None:
        step = change.update(name, cache_key=key, cache_pending=False, reason="")
        change.emit(subjects.SCHEDULER_COMMANDS, _enqueue(change.run, step, now))
        return change.result()
    change.set_step(name, "succeeded", f"reused the results of {hit.task_id}",
                    cache_key=key, cache_pending=False, cached_from=hit.task_id,
                    exit_code=0, started_at=now, ended_at=now)
    _after_step_ended(change, name, "succeeded")
    return change.result()


def apply_task_event(stored: StoredRun, event: events.TaskEvent, now: float) -> StoredRun | None:
    """Fold a node or scheduler report about one step into the run."""
    step = stored.run.step(event.step)
    if step is None or event.attempt != step.attempt or step.state in TERMINAL_STEP_STATES:
        return None
    change = _Change(stored, now)
    match event:
        case events.TaskPlaced():
            if step.state == "running" or step.node_id == event.node_id:
                return None
            change.update(step.name, node_id=event.node_id, gpu_ids=event.gpu_ids,
                          gpu_share=event.gpu_share, gpu_simulated=event.gpu_simulated)
        case events.TaskStarted():
            if step.state == "running":
                return None
            change.set_step(step.name, "running", node_id=event.node_id, started_at=event.at,
                            ended_at=None, exit_code=None, stdout_path=event.stdout_path,
                            stderr_path=event.stderr_path)
            if change.run.state == "queued":
                change.set_run("running", started_at=event.at)
        case events.TaskExited():
            _finish_attempt(change, step, event)
    return change.result()


def retry_decision(step: StepRecord, cause: str) -> Retry | None:
    """Whether a failed attempt is tried again, and after how long (pure policy).

    Infrastructure losses (node died or stopped, preemption) and program failures (non-zero
    exit, timeout, could not start) have separate budgets. Program failures wait: the delay
    grows by `factor` from `initial_delay_s` up to `max_delay_s`; infrastructure losses are
    retried at once (on another node)."""
    infrastructure = cause in INFRASTRUCTURE_CAUSES
    used = step.infra_failures if infrastructure else step.failures
    limit = step.retry.infrastructure if infrastructure else step.retry.failure
    if used >= limit:
        return None
    policy = step.retry
    # A lost node is not the program's fault and waiting does not help: restart at once
    # (elsewhere). Program failures back off.
    delay = 0.0 if infrastructure else min(policy.max_delay_s,
                                           policy.initial_delay_s * policy.factor ** used)
    return Retry(delay_s=delay, infrastructure=infrastructure, count=used + 1, limit=limit)


def _finish_attempt(change: _Change, step: StepRecord, event: events.TaskExited) -> None:
    record = AttemptRecord(attempt=step.attempt, node_id=event.node_id or step.node_id,
                           started_at=step.started_at or event.started_at,
                           ended_at=event.at, exit_code=event.exit_code, cause=event.cause,
                           reason=_failure_reason(event))
    fields: dict[str, object] = {
        "node_id": record.node_id, "exit_code": event.exit_code, "ended_at": event.at,
        "started_at": record.started_at, "history": (*step.history, record),
        "stdout_tail": event.stdout_tail[-TAIL_IN_RECORD_BYTES:],
        "stderr_tail": event.stderr_tail[-TAIL_IN_RECORD_BYTES:],
        "stdout_path": event.stdout_path or step.stdout_path,
        "stderr_path": event.stderr_path or step.stderr_path,
        "energy_j": step.energy_j if event.energy_j is None
        else (step.energy_j or 0.0) + event.energy_j}
    if change.run.cancel_requested or step.cancel_requested:
        why = change.run.reason if change.run.cancel_requested else "step cancelled"
        change.set_step(step.name, "cancelled", f"cancelled: {why or 'on request'}", **fields)
        _after_step_ended(change, step.name, "cancelled")
    elif _succeeded(event):
        change.set_step(step.name, "succeeded", "", **fields)
        _after_step_ended(change, step.name, "succeeded")
    elif event.cause == "preempted" and event.started:
        _requeue_preempted(change, step, record, fields)
    else:
        _fail_or_retry(change, step, event, record.reason, fields)


def attained_gpu_s(step: StepRecord, history: Iterable[AttemptRecord]) -> float:
    """GPU-seconds the step's attempts have held (what its priority's "held" term counts)."""
    return sum(max(0.0, (a.ended_at or 0.0) - (a.started_at or a.ended_at or 0.0))
               for a in history) * step.resources.gpus


def _requeue_preempted(change: _Change, step: StepRecord, record: AttemptRecord,
                       fields: dict[str, object]) -> None:
    """Preempted (or moved off a draining node) after a checkpoint-then-stop: not a failure.
    The next attempt is queued at once, uses no retry budget, and keeps its urgency, its
    first queue time and the GPU time it held, so it resumes where it stood in the queue."""
    change.set_step(step.name, "retrying",
                    f"{record.reason}; requeued with its priority (preemption "
                    f"{step.preemptions + 1}, no retry budget used)",
                    attempt=step.attempt + 1, preemptions=step.preemptions + 1,
                    fruitless_preemptions=fruitless_after_preemption(step), **fields)
    now_step = change.steps[step.name]
    enqueue = _enqueue(change.run, now_step, change.now)
    change.emit(subjects.SCHEDULER_COMMANDS, replace(
        enqueue, queued_at=step.queued_at or change.now,
        attained_gpu_s=attained_gpu_s(step, now_step.history)))


def fruitless_after_preemption(step: StepRecord) -> int:
    """An attempt preempted before it committed a checkpoint lost all its work: one more in
    a row; one that had committed made progress, and the count starts again."""
    return 0 if step.checkpointed_attempt == step.attempt else step.fruitless_preemptions + 1


def record_checkpoint(stored: StoredRun, name: str, attempt: int) -> StoredRun | None:
    """The checkpoint-store committed a checkpoint of attempt `attempt` of step `name`: if
    that is the current attempt, a later preemption of it is not fruitless. (Another
    attempt's, or a repeat: no change.)"""
    step = stored.run.step(name)
    if (step is None or attempt != step.attempt or step.state in TERMINAL_STEP_STATES
            or step.checkpointed_attempt == attempt):
        return None
    return replace(stored, run=replace(stored.run, steps=tuple(
        replace(s, checkpointed_attempt=attempt) if s.name == name else s
        for s in stored.run.steps)))


def _succeeded(event: events.TaskExited) -> bool:
    return (event.exit_code == 0 and event.started and event.cause == "exit"
            and not event.missing_outputs)


def _failure_reason(event: events.TaskExited) -> str:
    if event.exit_code == 0 and event.missing_outputs:
        return "declared output(s) missing: " + ", ".join(event.missing_outputs)
    return event.reason or f"exit code {event.exit_code}"


def _fail_or_retry(change: _Change, step: StepRecord, event: events.TaskExited, reason: str,
                   fields: dict[str, object]) -> None:
    retry = retry_decision(step, event.cause)
    if retry is None:
        tried = len(step.history)
        suffix = f" (after {tried} retr{'y' if tried == 1 else 'ies'})" if tried else ""
        change.set_step(step.name, "failed", reason + suffix, **fields)
        _after_step_ended(change, step.name, "failed")
        return
    kind = "infrastructure" if retry.infrastructure else "failure"
    counts = ({"infra_failures": step.infra_failures + 1} if retry.infrastructure
              else {"failures": step.failures + 1})
    change.set_step(step.name, "retrying",
                    f"{reason}; {kind} retry {retry.count} of {retry.limit} in "
                    f"{retry.delay_s:g}s", attempt=step.attempt + 1, **counts, **fields)
    change.emit(subjects.SCHEDULER_COMMANDS, _enqueue(
        change.run, change.steps[step.name], change.now, not_before=change.now + retry.delay_s))


def _after_step_ended(change: _Change, name: str, outcome: StepState) -> None:
    if outcome != "succeeded":
        for child in _declared_order(change, dag.descendants(change.graph(), name)):
            if change.steps[child].state == "pending":
                change.set_step(child, "skipped", f"upstream step {name} {outcome}")
    _release_ready(change)
    _finish_run_if_done(change)


def _declared_order(change: _Change, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    return [s.name for s in change.run.steps if s.name in wanted]


def _finish_run_if_done(change: _Change) -> None:
    if change.run.state in TERMINAL_RUN_STATES:
        return
    states = [s.state for s in change.steps.values()]
    if any(state not in TERMINAL_STEP_STATES for state in states):
        return
    failed = [s.name for s in change.steps.values() if s.state == "failed"]
    if change.run.cancel_requested:
        change.set_run("cancelled", change.run.reason or "cancelled on request",
                       ended_at=change.now)
    elif failed:
        change.set_run("failed", f"failed step(s): {', '.join(failed)}", ended_at=change.now)
    elif all(state == "succeeded" for state in states):
        change.set_run("succeeded", ended_at=change.now)
    else:
        change.set_run("cancelled", "some steps were cancelled", ended_at=change.now)


def request_cancel(stored: StoredRun, reason: str, now: float) -> StoredRun | None:
    """Cancel what has not started and ask the scheduler to stop what has."""
    if stored.run.state in TERMINAL_RUN_STATES or stored.run.cancel_requested:
        return None
    change = _Change(stored, now)
    change.run = replace(change.run, cancel_requested=True,
                         reason=reason or "cancelled on request")
    for step in stored.run.steps:
        _cancel_step(change, step, change.run.reason, "cancelled before it started")
    _finish_run_if_done(change)
    return change.result()


def request_cancel_step(stored: StoredRun, name: str, reason: str,
                        now: float) -> StoredRun | None:
    """Cancel one step (its dependents are skipped); the rest of the run goes on."""
    step = stored.run.step(name)
    if step is None or step.state in TERMINAL_STEP_STATES or step.cancel_requested:
        return None
    change = _Change(stored, now)
    change.update(name, cancel_requested=True)
    _cancel_step(change, change.steps[name], reason or "step cancelled",
                 f"cancelled: {reason or 'on request'}")
    if change.steps[name].state == "cancelled":
        _after_step_ended(change, name, "cancelled")
    return change.result()


def _cancel_step(change: _Change, step: StepRecord, reason: str, unstarted: str) -> None:
    if step.state in {"queued", "running", "retrying"} and not step.cache_pending:
        change.emit(subjects.SCHEDULER_COMMANDS, events.CancelTask(
            at=change.now, task_id=task_id(change.run.run_id, step.name),
            attempt=step.attempt, reason=reason))
    if step.state in {"pending", "queued", "retrying"}:
        change.set_step(step.name, "cancelled", unstarted, ended_at=change.now,
                        cache_pending=False)


def retry_run(stored: StoredRun, now: float) -> StoredRun | str:
    """Run again every step of a finished run that did not succeed; succeeded steps keep
    their results. Returns the reason as a string when there is nothing to retry."""
    run = stored.run
    if run.state not in TERMINAL_RUN_STATES:
        return f"run {run.run_id} is still {run.state}; cancel it first or wait for it"
    again = [s.name for s in run.steps if s.state != "succeeded"]
    if not again:
        return f"run {run.run_id} succeeded: every step has its results"
    change = _Change(stored, now)
    change.run = replace(change.run, cancel_requested=False)
    for name in again:
        # the retry budget and the thrash guard start again; `preemptions` stays history
        change.set_step(name, "pending", "retry requested", failures=0, infra_failures=0,
                        fruitless_preemptions=0, cancel_requested=False, exit_code=None,
                        ended_at=None)
    started = any(s.state == "succeeded" for s in run.steps)
    change.set_run("running" if started else "queued", f"retry of {len(again)} step(s)",
                   ended_at=None)
    _release_ready(change)
    return change.result()


def report_path_problem(event: events.ReportReady) -> str:
    """Why `event.path` cannot be the run's report ('' when it can): the report service
    writes `<reports>/<run_id>.html`, an absolute path without `..`; anything else (a
    report pointed at /etc/passwd) is refused."""
    path = PurePosixPath(event.path)
    if not path.is_absolute() or ".." in path.parts or path.name != f"{event.run_id}.html":
        return (f"report_ready for {event.run_id} names {event.path[:200]!r}, not an "
                f"absolute path to {event.run_id}.html")
    return ""


def record_report(stored: StoredRun, event: events.ReportReady) -> StoredRun | None:
    if stored.run.report_path == event.path or report_path_problem(event):
        return None
    return replace(stored, run=replace(stored.run, report_path=event.path))


def without_published(stored: StoredRun, msg_ids: Iterable[str]) -> StoredRun:
    """The run with the given outbox messages removed (they are on the bus now)."""
    done = set(msg_ids)
    return replace(stored, outbox=tuple(o for o in stored.outbox if o.msg_id not in done))


def pending_cache_lookups(stored: StoredRun) -> list[str]:
    """Released steps still waiting for their cache lookup (the shell does the lookup)."""
    return [s.name for s in stored.run.steps if s.state == "queued" and s.cache_pending]
