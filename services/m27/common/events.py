"""Every message on the bus: events (what happened) and commands (what to do).

Each is a frozen msgspec Struct tagged by a `type` field, encoded as plain JSON, so any NATS
client can read them, e.g.
`{"type":"step_state_changed","run_id":"r-…","step":"train","state":"running",…}`.
Schema evolution: new fields get defaults; existing fields never change meaning.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from m27.common.model import (
    AnomalyAction,
    AnomalyKind,
    ExitCause,
    GpuBackend,
    GpuInfo,
    GpuSample,
    MonitorSpec,
    Resources,
    RunState,
    StepState,
    StepType,
    TaskHolding,
    Urgency,
)
from m27.common.platform import Platform

_TAG: Final = "type"


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field=_TAG):
    """Base: every message carries its time (unix seconds)."""

    at: float


# ---------------------------------------------------------------- events: runs and steps


class RunSubmitted(_Message, frozen=True, tag="run_submitted"):
    run_id: str
    name: str
    user: str
    urgency: Urgency
    steps: tuple[str, ...]


class RunStateChanged(_Message, frozen=True, tag="run_state_changed"):
    run_id: str
    state: RunState
    previous: RunState | None
    reason: str = ""


class StepStateChanged(_Message, frozen=True, tag="step_state_changed"):
    run_id: str
    step: str
    state: StepState
    previous: StepState
    attempt: int = 0
    node_id: str | None = None
    exit_code: int | None = None
    reason: str = ""


class ReportReady(_Message, frozen=True, tag="report_ready"):
    run_id: str
    path: str


# ---------------------------------------------------------------- events: tasks on nodes


class TaskPlaced(_Message, frozen=True, tag="task_placed"):
    """The scheduler gave a task a node (and GPUs); the start command is on its way."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0
    gpu_simulated: bool = False
    reason: str = ""


class TaskStarted(_Message, frozen=True, tag="task_started"):
    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    pid: int
    stdout_path: str = ""
    stderr_path: str = ""


class TaskExited(_Message, frozen=True, tag="task_exited"):
    """The task's process group is gone. `exit_code` follows the shell: 128+N for signal N.

    `cause` says why it ended, which decides how it may be retried: `exit` (the program
    ended by itself), `not_started` (it could not be started: bad workdir, ...), `timeout`
    (it ran past its `timeout:`), `stopped` (a StopTask: cancelled), `superseded` (a newer
    attempt replaced it) — and the infrastructure causes `node_stopped` (its agent shut
    down), `agent_restarted` (a crashed agent's successor reaped it), `lost` (the scheduler
    stopped hearing its node; its real fate there is unknown), `preempted`.
    `missing_outputs` lists declared outputs that did not exist after a zero exit.
    """

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    exit_code: int | None  # None: unknown (the node was lost)
    signal: int | None = None
    started: bool = True
    started_at: float | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    stdout_path: str = ""
    stderr_path: str = ""
    reason: str = ""
    cause: ExitCause = "exit"
    missing_outputs: tuple[str, ...] = ()
    energy_j: float | None = None  # its share of its GPUs' energy while it ran


class TaskIdle(_Message, frozen=True, tag="task_idle"):
    """A running task leaves its GPU share idle (I/O wait): capacity others could use."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...]
    idle_share: float  # of each listed GPU
    utilization_pct: float
    reason: str  # "gpu_idle" (N samples under the threshold) or "io_phase" (reported)


class TaskBusy(_Message, frozen=True, tag="task_busy"):
    """A task that was idle uses its GPU share again."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    utilization_pct: float


class TaskStaged(_Message, frozen=True, tag="task_staged"):
    """Ready pool: a waiting task's inputs are in the page cache of this node, so it starts
    there without waiting on cold storage. `missing` are inputs that did not exist (yet)."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    files: int
    bytes: int
    seconds: float
    missing: tuple[str, ...] = ()
    #: Files left out: over the node's staging limit, or not regular files (FIFOs, devices).
    skipped: int = 0


class TaskOverShare(_Message, frozen=True, tag="task_over_share"):
    """A task uses more GPU memory than its share; `action` says what the agent did."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    gpu_index: int
    used_mb: int
    limit_mb: int
    action: Literal["warned", "stopped"]


class TrainingAnomaly(_Message, frozen=True, tag="training_anomaly"):
    """The step's training monitor (its `monitor:`) saw an abnormal value of a metric it
    logs (`m27.common.training_monitor`); `actions` is what the node-agent did or asks for:
    "checkpoint" (the step's checkpoint signal, sent at once), "notify" (for the people
    watching), "stop" (the attempt is stopped, cause `anomaly`). A value that is not
    finite is the string "NaN", "Infinity" or "-Infinity", as in metric points."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    kind: AnomalyKind
    metric: str
    train_step: int
    value: float | str
    baseline: float | None = None
    detail: str = ""
    actions: tuple[AnomalyAction, ...] = ()


class CheckpointCommitted(_Message, frozen=True, tag="checkpoint_committed"):
    """The checkpoint-store made a checkpoint of a task visible (its chunks durable, its
    manifest stored). Published on the task's events subject; the scheduler uses it to
    pick preemption victims that lose the least work."""

    task_id: str
    attempt: int
    checkpoint_id: str
    step: int | None = None  # the training step it was taken after, if known
    size_bytes: int = 0
    new_bytes: int = 0


class CheckpointCorrupt(_Message, frozen=True, tag="checkpoint_corrupt"):
    """The checkpoint-store found a checkpoint with a missing or damaged chunk while
    looking for a task's latest one, and handed out `fell_back_to` instead (empty: no
    good checkpoint was left). Published on the task's events subject."""

    task_id: str
    checkpoint_id: str
    chunk_id: str
    fell_back_to: str = ""
    reason: str = ""  # e.g. "missing", "4096 bytes on disk, 4100 expected"


# ---------------------------------------------------------------- events: nodes


class NodeRegistered(_Message, frozen=True, tag="node_registered"):
    node_id: str
    hostname: str
    backend: GpuBackend
    gpus: tuple[GpuInfo, ...]
    cpu_slots: int
    platform: Platform = Platform()


class NodeHeartbeat(_Message, frozen=True, tag="node_heartbeat"):
    """Sent every `[node] heartbeat_interval` on core NATS (not stored in a stream)."""

    node_id: str
    backend: GpuBackend
    gpus: tuple[GpuSample, ...] = ()
    running: tuple[str, ...] = ()
    incarnation: str = ""
    seq: int = 0  # sent only after renewal `seq` of the node's lease was stored
    tasks: tuple[TaskHolding, ...] = ()


class GpuMemoryLeak(_Message, frozen=True, tag="gpu_memory_leak"):
    """GPU memory still held after its task ended (by its processes or orphans of it)."""

    node_id: str
    gpu_index: int
    task_id: str
    pids: tuple[int, ...]
    memory_mb: int
    cleaned: bool  # the processes were ours, the task was over: they were killed


class NodeStopping(_Message, frozen=True, tag="node_stopping"):
    """The agent is shutting down: it takes no new work, and its tasks are being stopped
    (each with its grace period to checkpoint)."""

    node_id: str
    reason: str = ""


class NodeStopped(_Message, frozen=True, tag="node_stopped"):
    """The agent shut down cleanly (its tasks were stopped first)."""

    node_id: str
    reason: str = ""


class NodeLost(_Message, frozen=True, tag="node_lost"):
    """The scheduler stopped hearing a node's heartbeats."""

    node_id: str
    last_heartbeat: float


class NodePlatformDiffers(_Message, frozen=True, tag="node_platform_differs"):
    """The node's driver or CUDA version differs from most nodes' (a lab runs one of
    each); `differences` empty: it agrees again. From the scheduler, when it changes."""

    node_id: str
    differences: tuple[str, ...]
    platform: Platform


WindowPhase = Literal["draining", "running", "succeeded", "failed"]


class NodeMaintenanceWindow(_Message, frozen=True, tag="node_maintenance_window"):
    """A maintenance window of the node, from the scheduler: it began (`draining`: no new
    work, running work is stopped and moves elsewhere), its command was sent (`running`),
    and how it ended (`succeeded`: the node takes work again; `failed`: it stays cordoned,
    `detail` says why, with the command's output)."""

    node_id: str
    phase: WindowPhase
    occurrence: float  # the window's start this is about (unix seconds)
    command: str = ""
    detail: str = ""
    exit_code: int | None = None
    output_tail: str = ""
    duration_s: float | None = None
    next_at: float | None = None  # the next occurrence, when there is one


class MaintenanceCommandDone(_Message, frozen=True, tag="maintenance_command_done"):
    """Node-agent → scheduler (on the node's events): the window's command ended."""

    node_id: str
    occurrence: float
    exit_code: int | None  # None: it did not run, or was killed at its time limit
    output_tail: str = ""  # the last few KiB of its stdout and stderr
    duration_s: float = 0.0
    error: str = ""  # why it did not run or did not finish


Event = (
    RunSubmitted
    | RunStateChanged
    | StepStateChanged
    | ReportReady
    | TaskPlaced
    | TaskStarted
    | TaskExited
    | TaskIdle
    | TaskBusy
    | TaskStaged
    | TaskOverShare
    | TrainingAnomaly
    | CheckpointCommitted
    | CheckpointCorrupt
    | GpuMemoryLeak
    | NodeRegistered
    | NodeHeartbeat
    | NodeStopping
    | NodeStopped
    | NodeLost
    | NodePlatformDiffers
    | NodeMaintenanceWindow
    | MaintenanceCommandDone
)
TaskEvent = TaskPlaced | TaskStarted | TaskExited


# ---------------------------------------------------------------- commands


class EnqueueTask(_Message, frozen=True, tag="enqueue_task"):
    """Orchestrator → scheduler: this step's dependencies succeeded; find it a place."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    step_type: StepType
    resources: Resources
    urgency: Urgency
    user: str
    command: str
    workdir: str = ""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    #: The m27_secrets key of the step's secret environment values ("" none): the values
    #: never travel in a message, the node-agent reads them when it starts the task.
    secrets: str = ""
    checkpoint_interval_s: float | None = None
    timeout_s: float | None = None
    outputs: tuple[str, ...] = ()
    preemptible: bool = False
    not_before: float = 0.0  # a retry's backoff: not to be started before this time
    checkpoint_signal: str = "SIGUSR1"
    monitor: tuple[MonitorSpec, ...] = ()  # the training monitor (the step's `monitor:`)
    #: Absolute paths the step reads (its `inputs:` and its dependencies' `outputs:`): what
    #: the ready pool stages onto the node the task will most likely start on.
    inputs: tuple[str, ...] = ()
    #: A preempted task's requeue keeps its place: when it first entered the queue (0: now)
    #: and the GPU-seconds its earlier attempts held (aging, "long holders yield").
    queued_at: float = 0.0
    attained_gpu_s: float = 0.0
    #: Times this step was preempted (or moved off a draining node), all attempts together.
    preemptions: int = 0
    #: Consecutive latest preemptions whose attempt had committed no checkpoint (no durable
    #: progress); 0 after one that had. The policy stops preempting a task that thrashes.
    fruitless_preemptions: int = 0


class CancelTask(_Message, frozen=True, tag="cancel_task"):
    """Orchestrator → scheduler: drop the task if queued, stop it if running."""

    task_id: str
    attempt: int
    reason: str = ""


class StartTask(_Message, frozen=True, tag="start_task"):
    """Scheduler → node-agent: run this step now on these GPUs."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    step_type: StepType
    command: str
    workdir: str = ""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    #: The m27_secrets key of the step's secret environment values ("" none): the values
    #: never travel in a message, the node-agent reads them when it starts the task.
    secrets: str = ""
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0
    gpu_memory_mb: int = 0
    checkpoint_interval_s: float | None = None
    timeout_s: float | None = None  # the agent stops the task after this long
    outputs: tuple[str, ...] = ()  # declared outputs, checked after a zero exit
    checkpoint_signal: str = "SIGUSR1"  # sent for checkpoint requests and each interval
    monitor: tuple[MonitorSpec, ...] = ()  # what the agent watches in its metrics
    cpus: int = 1
    memory_mb: int = 0


class StopTask(_Message, frozen=True, tag="stop_task"):
    """Scheduler → node-agent: SIGTERM the task's process group, SIGKILL after `grace_s`."""

    task_id: str
    attempt: int
    grace_s: float = 10.0
    reason: str = ""
    #: What the agent reports as the exit's cause: "preempted" (preemption, drain) is
    #: requeued without using a retry budget; "stopped" is a cancel.
    cause: Literal["stopped", "preempted"] = "stopped"


class CheckpointTask(_Message, frozen=True, tag="checkpoint_task"):
    """Ask a running task to checkpoint now (its `checkpoint_signal`, SIGUSR1 by default)."""

    task_id: str
    attempt: int
    reason: str = ""


class PauseTask(_Message, frozen=True, tag="pause_task"):
    """SIGSTOP the task's process group (backfill yields to the main task)."""

    task_id: str
    attempt: int
    reason: str = ""


class ResumeTask(_Message, frozen=True, tag="resume_task"):
    """SIGCONT a paused task's process group."""

    task_id: str
    attempt: int
    reason: str = ""


class StageTask(_Message, frozen=True, tag="stage_task"):
    """Ready pool: read this waiting task's inputs into the node's page cache (the agent
    answers with `task_staged`)."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    inputs: tuple[str, ...]
    reason: str = ""


class RunMaintenance(_Message, frozen=True, tag="run_maintenance"):
    """Scheduler → node-agent: the node is empty for its maintenance window; run `command`
    (through /bin/sh, in its own process group, killed after `timeout_s`) and answer with
    `maintenance_command_done`. Refused while the agent still runs tasks."""

    node_id: str
    occurrence: float
    command: str
    timeout_s: float


class SecretsRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A node-agent asks for the secret environment values of one attempt it starts
    (`subjects.SECRETS_REQUEST`, core NATS request/reply, never stored)."""

    task_id: str
    attempt: int
    key: str  # StartTask.secrets


class SecretsReply(msgspec.Struct, frozen=True, kw_only=True):
    """The values, or why not (`error`, the values then empty)."""

    env: dict[str, str] = msgspec.field(default_factory=dict)
    error: str = ""
    transient: bool = False  # the error may pass: ask again later


# ---------------------------------------------------------------- training metrics


class MetricPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One logged training step: its scalars (a value that is not finite is the string
    "NaN", "Infinity" or "-Infinity", as JSON cannot spell it) and its wall time."""

    step: int
    at: float
    values: dict[str, float | str]


class MetricPoints(_Message, frozen=True, tag="metric_points"):
    """Points a step's program logged (`m27.train.log` or `$M27_METRICS_FILE`), as its
    node-agent read them, in file order. `offset` is where in the attempt's metrics file
    the first of them starts (what makes a re-publish recognisable)."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    node_id: str
    offset: int
    points: tuple[MetricPoint, ...]


# ---------------------------------------------------------------- GPU telemetry


class GpuTelemetry(_Message, frozen=True, tag="gpu_telemetry"):
    """A node's GPU readings at one heartbeat (`[node] heartbeat_interval`) and who held
    what, stored in M27_TELEMETRY for the history (the heartbeat itself is core NATS, for
    the scheduler only). `incarnation` and `seq` are the lease renewal's: the message id."""

    node_id: str
    incarnation: str
    seq: int
    backend: GpuBackend
    gpus: tuple[GpuSample, ...] = ()
    tasks: tuple[TaskHolding, ...] = ()


SchedulerCommand = EnqueueTask | CancelTask
NodeCommand = (StartTask | StopTask | CheckpointTask | PauseTask | ResumeTask | StageTask
               | RunMaintenance)
Command = SchedulerCommand | NodeCommand
Message = Event | Command | MetricPoints | GpuTelemetry

_encoder: Final = msgspec.json.Encoder()
_event_decoder: Final = msgspec.json.Decoder(Event)
_scheduler_command_decoder: Final = msgspec.json.Decoder(SchedulerCommand)
_node_command_decoder: Final = msgspec.json.Decoder(NodeCommand)
_message_decoder: Final = msgspec.json.Decoder(Message)


def encode(message: Message) -> bytes:
    """JSON bytes of any event or command, with its `type` tag."""
    return _encoder.encode(message)


def decode_event(data: bytes) -> Event:
    """Raises msgspec.ValidationError / DecodeError for anything that is not an Event."""
    return _event_decoder.decode(data)


def decode_scheduler_command(data: bytes) -> SchedulerCommand:
    return _scheduler_command_decoder.decode(data)


def decode_node_command(data: bytes) -> NodeCommand:
    return _node_command_decoder.decode(data)


_metrics_decoder: Final = msgspec.json.Decoder(MetricPoints)
_telemetry_decoder: Final = msgspec.json.Decoder(GpuTelemetry)


def decode_metrics(data: bytes) -> MetricPoints:
    return _metrics_decoder.decode(data)


def decode_telemetry(data: bytes) -> GpuTelemetry:
    return _telemetry_decoder.decode(data)


def decode_message(data: bytes) -> Message:
    return _message_decoder.decode(data)


def tag_of(message: Message) -> str:
    """The `type` string a message carries on the wire."""
    tag = type(message).__struct_config__.tag
    assert isinstance(tag, str)
    return tag
