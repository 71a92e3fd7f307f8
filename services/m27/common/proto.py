"""Protobuf ↔ domain conversion, the only place that knows both (protobuf stays at the edge)."""

from __future__ import annotations

from typing import Final, get_args

from m27.common import events
from m27.common.model import (
    TERMINAL_RUN_STATES,
    AttemptRecord,
    ExitCause,
    Resources,
    RunRecord,
    RunState,
    StepRecord,
    StepState,
    StepType,
    Urgency,
)
from m27.v1 import pipeline_pb2 as pb

#: What a secret value reads as wherever m27 shows it.
MASKED: Final = "***"

_URGENCY_TO_PB: Final[dict[Urgency, pb.Urgency.ValueType]] = {
    "low": pb.URGENCY_LOW, "normal": pb.URGENCY_NORMAL,
    "high": pb.URGENCY_HIGH, "urgent": pb.URGENCY_URGENT,
}
_URGENCY_FROM_PB: Final = {v: k for k, v in _URGENCY_TO_PB.items()}
_RUN_STATE_TO_PB: Final[dict[RunState, pb.RunState.ValueType]] = {
    "queued": pb.RUN_STATE_QUEUED, "running": pb.RUN_STATE_RUNNING,
    "succeeded": pb.RUN_STATE_SUCCEEDED, "failed": pb.RUN_STATE_FAILED,
    "cancelled": pb.RUN_STATE_CANCELLED,
}
_RUN_STATE_FROM_PB: Final = {v: k for k, v in _RUN_STATE_TO_PB.items()}
_STEP_STATE_TO_PB: Final[dict[StepState, pb.StepState.ValueType]] = {
    "pending": pb.STEP_STATE_PENDING, "queued": pb.STEP_STATE_QUEUED,
    "running": pb.STEP_STATE_RUNNING, "retrying": pb.STEP_STATE_RETRYING,
    "succeeded": pb.STEP_STATE_SUCCEEDED,
    "failed": pb.STEP_STATE_FAILED, "cancelled": pb.STEP_STATE_CANCELLED,
    "skipped": pb.STEP_STATE_SKIPPED,
}
_STEP_STATE_FROM_PB: Final = {v: k for k, v in _STEP_STATE_TO_PB.items()}
_STEP_TYPE_TO_PB: Final[dict[StepType, pb.StepType.ValueType]] = {
    "cpu": pb.STEP_TYPE_CPU, "gpu": pb.STEP_TYPE_GPU, "gpu_light": pb.STEP_TYPE_GPU_LIGHT,
}
_STEP_TYPE_FROM_PB: Final = {v: k for k, v in _STEP_TYPE_TO_PB.items()}


def urgency_to_proto(urgency: Urgency) -> pb.Urgency.ValueType:
    return _URGENCY_TO_PB[urgency]


def urgency_from_proto(value: pb.Urgency.ValueType) -> Urgency:
    """URGENCY_UNSPECIFIED means normal."""
    return _URGENCY_FROM_PB.get(value, "normal")


def run_state_from_proto(value: pb.RunState.ValueType) -> RunState:
    """ValueError for a value that is no run state (an older or a hostile client)."""
    try:
        return _RUN_STATE_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown run state {value}") from None


def run_state_to_proto(state: RunState) -> pb.RunState.ValueType:
    return _RUN_STATE_TO_PB[state]


def _time(value: float | None) -> float:
    return value or 0.0


def _opt_time(value: float) -> float | None:
    return value or None


def _resources_to_proto(resources: Resources) -> pb.Resources:
    return pb.Resources(gpus=resources.gpus, cpus=resources.cpus,
                        gpu_memory_mb=resources.gpu_memory_mb, memory_mb=resources.memory_mb,
                        gpu_model=resources.gpu_model, driver=resources.driver,
                        cuda=resources.cuda)


def _attempt_to_proto(attempt: AttemptRecord) -> pb.Attempt:
    message = pb.Attempt(attempt=attempt.attempt, node_id=attempt.node_id or "",
                         started_at=_time(attempt.started_at), ended_at=attempt.ended_at,
                         cause=attempt.cause, reason=attempt.reason)
    if attempt.exit_code is not None:
        message.exit_code = attempt.exit_code
    return message


def _attempt_from_proto(message: pb.Attempt) -> AttemptRecord:
    cause: ExitCause = next((c for c in get_args(ExitCause) if c == message.cause), "exit")
    return AttemptRecord(
        attempt=message.attempt, node_id=message.node_id or None,
        started_at=_opt_time(message.started_at), ended_at=message.ended_at,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        cause=cause, reason=message.reason)


def step_to_proto(step: StepRecord) -> pb.Step:
    message = pb.Step(
        name=step.name, type=_STEP_TYPE_TO_PB[step.type], state=_STEP_STATE_TO_PB[step.state],
        depends_on=list(step.depends_on), command=step.command, attempt=step.attempt,
        node_id=step.node_id or "", gpu_ids=list(step.gpu_ids), gpu_share=step.gpu_share,
        gpu_simulated=step.gpu_simulated, stderr_tail=step.stderr_tail,
        stdout_tail=step.stdout_tail, queued_at=_time(step.queued_at),
        started_at=_time(step.started_at), ended_at=_time(step.ended_at), reason=step.reason,
        output=step.output or "", stdout_path=step.stdout_path, stderr_path=step.stderr_path,
        outputs=list(step.outputs), inputs=list(step.inputs), group=step.group,
        matrix=dict(step.matrix), failures=step.failures, infra_failures=step.infra_failures,
        preemptions=step.preemptions,
        history=[_attempt_to_proto(a) for a in step.history], cached_from=step.cached_from,
        urgency=_URGENCY_TO_PB[step.urgency], preemptible=step.preemptible,
        timeout_s=step.timeout_s or 0.0, workdir=step.workdir,
        resources=_resources_to_proto(step.resources), energy_j=step.energy_j or 0.0,
        checkpoint_interval_s=step.checkpoint_interval_s or 0.0,
        env={**step.env, **dict.fromkeys(step.secret_env, MASKED)},
        secret_env=list(step.secret_env),
    )
    if step.exit_code is not None:
        message.exit_code = step.exit_code
    return message


def step_from_proto(message: pb.Step) -> StepRecord:
    r = message.resources
    return StepRecord(
        name=message.name, type=_STEP_TYPE_FROM_PB.get(message.type, "cpu"),
        state=_STEP_STATE_FROM_PB.get(message.state, "pending"),
        depends_on=tuple(message.depends_on), command=message.command,
        attempt=message.attempt, node_id=message.node_id or None,
        gpu_ids=tuple(message.gpu_ids), gpu_share=message.gpu_share,
        gpu_simulated=message.gpu_simulated,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        stderr_tail=message.stderr_tail, stdout_tail=message.stdout_tail,
        queued_at=_opt_time(message.queued_at), started_at=_opt_time(message.started_at),
        ended_at=_opt_time(message.ended_at), reason=message.reason,
        outputs=tuple(message.outputs) or ((message.output,) if message.output else ()),
        inputs=tuple(message.inputs), group=message.group, matrix=dict(message.matrix),
        failures=message.failures, infra_failures=message.infra_failures,
        preemptions=message.preemptions,
        history=tuple(_attempt_from_proto(a) for a in message.history),
        cached_from=message.cached_from, urgency=urgency_from_proto(message.urgency),
        preemptible=message.preemptible, timeout_s=message.timeout_s or None,
        workdir=message.workdir,
        resources=Resources(gpus=r.gpus, cpus=r.cpus or 1, gpu_memory_mb=r.gpu_memory_mb,
                            memory_mb=r.memory_mb, gpu_model=r.gpu_model, driver=r.driver,
                            cuda=r.cuda),
        stdout_path=message.stdout_path, stderr_path=message.stderr_path,
        energy_j=message.energy_j or None,
        checkpoint_interval_s=message.checkpoint_interval_s or None,
        env={k: v for k, v in message.env.items() if k not in message.secret_env},
        secret_env=tuple(message.secret_env),
    )


def run_to_proto(run: RunRecord) -> pb.Run:
    return pb.Run(
        run_id=run.run_id, name=run.name, user=run.user,
        urgency=_URGENCY_TO_PB[run.urgency], state=_RUN_STATE_TO_PB[run.state],
        created_at=run.created_at, started_at=_time(run.started_at),
        ended_at=_time(run.ended_at), steps=[step_to_proto(s) for s in run.steps],
        report_path=run.report_path, reason=run.reason, workdir=run.workdir,
        use_cache=run.use_cache, source_name=run.source_name,
    )


def run_from_proto(message: pb.Run) -> RunRecord:
    return RunRecord(
        run_id=message.run_id, name=message.name, user=message.user,
        urgency=urgency_from_proto(message.urgency),
        state=_RUN_STATE_FROM_PB.get(message.state, "queued"),
        created_at=message.created_at, started_at=_opt_time(message.started_at),
        ended_at=_opt_time(message.ended_at),
        steps=tuple(step_from_proto(s) for s in message.steps),
        report_path=message.report_path, reason=message.reason, workdir=message.workdir,
        use_cache=message.use_cache, source_name=message.source_name,
    )


def summary_to_proto(run: RunRecord) -> pb.RunSummary:
    return pb.RunSummary(
        run_id=run.run_id, name=run.name, user=run.user, state=_RUN_STATE_TO_PB[run.state],
        created_at=run.created_at, ended_at=_time(run.ended_at), steps_total=len(run.steps),
        steps_succeeded=sum(s.state == "succeeded" for s in run.steps),
        steps_failed=sum(s.state == "failed" for s in run.steps),
    )


def event_to_proto(event: events.Event, sequence: int = 0) -> pb.RunEvent:
    """The run-level events a watcher sees; other events keep only their tag and time."""
    message = pb.RunEvent(type=events.tag_of(event), at=event.at, sequence=sequence)
    match event:
        case events.RunSubmitted(run_id=run_id):
            message.run_id = run_id
            message.state = "queued"
        case events.RunStateChanged(run_id=run_id, state=state, previous=previous,
                                    reason=reason):
            message.run_id, message.state, message.reason = run_id, state, reason
            message.previous = previous or ""
        case events.StepStateChanged():
            message.run_id, message.step = event.run_id, event.step
            message.state, message.previous = event.state, event.previous
            message.attempt, message.node_id = event.attempt, event.node_id or ""
            message.reason = event.reason
            if event.exit_code is not None:
                message.exit_code = event.exit_code
        case events.ReportReady(run_id=run_id, path=path):
            message.run_id, message.report_path = run_id, path
        case _:
            pass
    return message


def is_final_event(event: pb.RunEvent) -> bool:
    """A watch stream ends after the run's final event."""
    return event.type == "run_state_changed" and event.state in TERMINAL_RUN_STATES
