"""Domain types shared by the services: runs, steps, resources, nodes and GPUs.

These are the shapes on the bus, in KV and in the cores. Protobuf types never get past
the gRPC edge (see `m27.common.proto`). Schema evolution: add fields with defaults only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

import msgspec

from m27.common.platform import Platform, Requirements

StepType = Literal["cpu", "gpu", "gpu_light"]
StepState = Literal[
    "pending", "queued", "running", "retrying", "succeeded", "failed", "cancelled", "skipped"
]
RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Urgency = Literal["low", "normal", "high", "urgent"]
GpuBackend = Literal["nvml", "simulated", "none"]
ExitCause = Literal[
    "exit", "not_started", "timeout", "stopped", "superseded", "over_share",
    "node_stopped", "agent_restarted", "lost", "preempted", "fenced", "anomaly",
]
#: Ends that are the infrastructure's fault, not the program's: retried separately.
INFRASTRUCTURE_CAUSES: Final[frozenset[str]] = frozenset(
    {"node_stopped", "agent_restarted", "lost", "preempted", "fenced"}
)

STEP_TYPES: Final[tuple[StepType, ...]] = ("cpu", "gpu", "gpu_light")
#: Signals a step may ask to get for "checkpoint now" (never one that stops it).
#: "none": a program that checkpoints on its own schedule (and would die of a signal it
#: does not handle) is never signalled; its files are still uploaded every interval.
NO_CHECKPOINT_SIGNAL: Final = "none"
CHECKPOINT_SIGNALS: Final = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT", "SIGWINCH",
                             NO_CHECKPOINT_SIGNAL)
URGENCIES: Final[tuple[Urgency, ...]] = ("low", "normal", "high", "urgent")
TERMINAL_STEP_STATES: Final[frozenset[str]] = frozenset(
    {"succeeded", "failed", "cancelled", "skipped"}
)
TERMINAL_RUN_STATES: Final[frozenset[str]] = frozenset({"succeeded", "failed", "cancelled"})

#: GPU capacity is counted in tenths, the smallest share a step can ask for.
TENTHS_PER_GPU: Final = 10


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    """What one step holds while it runs.

    `gpus`: 0 for none, 0.1-0.9 for a share of one GPU, a whole number N for N whole GPUs
    on one node.
    """

    gpus: float = 0.0
    cpus: int = 1
    gpu_memory_mb: int = 0  # 0: the share's proportion of the GPU's memory
    memory_mb: int = 0  # 0: no limit asked for
    #: Where it may run (m27.common.platform): GPU model words ("A100|H100"), and driver
    #: and CUDA version requirements (">=12.1"); "" for none.
    gpu_model: str = ""
    driver: str = ""
    cuda: str = ""

    @property
    def requirements(self) -> Requirements:
        return Requirements(gpu_model=self.gpu_model, driver=self.driver, cuda=self.cuda)

    @property
    def gpu_tenths(self) -> int:
        """The GPU request in tenths of one GPU (a whole GPU is 10)."""
        return round(self.gpus * TENTHS_PER_GPU)


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How often a step is tried again, kept apart by cause (users ask for exactly this
    split: a node dying is not the program's fault). Delay: initial × factor^(n-1), capped."""

    failure: int = 0  # program failures: non-zero exit, timeout, could not start
    infrastructure: int = 3  # node lost or stopped, preempted
    initial_delay_s: float = 10.0
    factor: float = 2.0
    max_delay_s: float = 600.0


MonitorMode = Literal["min", "max"]
AnomalyKind = Literal["nan", "spike", "divergence", "plateau"]
AnomalyAction = Literal["checkpoint", "notify", "stop"]
MONITOR_MODES: Final[tuple[MonitorMode, ...]] = ("min", "max")
ANOMALY_ACTIONS: Final[tuple[AnomalyAction, ...]] = ("checkpoint", "notify", "stop")


class MonitorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One metric a step's training monitor watches (the step's `monitor:`), what is
    abnormal for it (`m27.common.training_monitor`) and what the node-agent does then."""

    metric: str = "loss"
    mode: MonitorMode = "min"  # lower is better (a loss) or higher (an accuracy)
    window: int = 50  # finite values the spike baseline (a rolling median) is taken over
    warmup: int = 10  # finite values seen before a spike can be called
    spike: float = 6.0  # k: beyond median ± k robust standard deviations; 0 turns it off
    divergence: int = 10  # worse than the value before, this many times in a row; 0 off
    plateau: int = 0  # values in a row without a new best; 0 off
    min_delta: float = 0.0  # relative improvement that counts as a new best (plateau)
    on_anomaly: tuple[AnomalyAction, ...] = ("checkpoint", "notify")


class AttemptRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished attempt of a step, kept in its history."""

    attempt: int
    node_id: str | None
    started_at: float | None
    ended_at: float
    exit_code: int | None
    cause: ExitCause
    reason: str


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a run: its definition and where it is in its life."""

    name: str
    type: StepType
    command: str
    depends_on: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    checkpoint_interval_s: float | None = None
    resources: Resources = Resources()
    urgency: Urgency = "normal"
    preemptible: bool = False
    retry: RetryPolicy = RetryPolicy()
    timeout_s: float | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)  # the plain values only
    #: Names of the secret environment values; the values are not in the record but in
    #: m27_secrets, as set `secret_set` of the run (-1: none).
    secret_env: tuple[str, ...] = ()
    secret_set: int = -1
    workdir: str = ""  # empty: the run's working directory
    group: str = ""  # the matrix step this one was expanded from
    matrix: dict[str, str] = msgspec.field(default_factory=dict)
    state: StepState = "pending"
    attempt: int = 0
    failures: int = 0
    infra_failures: int = 0
    preemptions: int = 0  # requeued after a preemption or drain (uses no retry budget)
    #: Consecutive latest preemptions whose attempt had committed no checkpoint; what the
    #: scheduler's thrash protection reads (`[scheduler] max_fruitless_preemptions`).
    fruitless_preemptions: int = 0
    #: The latest attempt a `checkpoint_committed` was seen for (0: none): whether the
    #: attempt a preemption ends made durable progress.
    checkpointed_attempt: int = 0
    node_id: str | None = None
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0
    gpu_simulated: bool = False
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    stdout_path: str = ""
    stderr_path: str = ""
    queued_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    reason: str = ""
    history: tuple[AttemptRecord, ...] = ()
    cache_key: str = ""
    cache_pending: bool = False  # released, waiting for the cache lookup
    cached_from: str = ""  # `<run_id>/<step>` whose results this step reused
    cancel_requested: bool = False  # `m27 cancel RUN --step NAME`
    checkpoint_signal: str = "SIGUSR1"  # what asks the step to checkpoint now
    monitor: tuple[MonitorSpec, ...] = ()  # the training monitor's metrics
    energy_j: float | None = None  # GPU energy of its attempts (its share of each GPU)

    @property
    def output(self) -> str | None:
        return self.outputs[0] if self.outputs else None


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A submitted pipeline and the state of all of its steps (steps in plan order)."""

    run_id: str
    name: str
    user: str
    urgency: Urgency
    state: RunState
    created_at: float
    steps: tuple[StepRecord, ...]
    workdir: str = ""
    vars: dict[str, str] = msgspec.field(default_factory=dict)
    started_at: float | None = None
    ended_at: float | None = None
    cancel_requested: bool = False
    report_path: str = ""
    reason: str = ""
    max_parallel: dict[str, int] = msgspec.field(default_factory=dict)  # matrix group → cap
    use_cache: bool = True
    source_name: str = ""
    #: The m27_secrets key of each set of secret values (StepRecord.secret_set indexes it).
    secret_keys: tuple[str, ...] = ()

    def step(self, name: str) -> StepRecord | None:
        return next((s for s in self.steps if s.name == name), None)


class RunEnd(msgspec.Struct, frozen=True):
    """Whether and when a run ended: the part of its stored record (KV m27_runs holds
    `{"run": RunRecord, ...}`, `orchestrator.runs.StoredRun`) the checkpoint-store reads."""

    state: RunState
    ended_at: float | None = None


class StoredRunEnd(msgspec.Struct, frozen=True):
    run: RunEnd


class SecretSet(msgspec.Struct, frozen=True, kw_only=True):
    """One set of a run's secret environment values, as stored in m27_secrets."""

    run_id: str
    env: dict[str, str]


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU as its node registered it. `simulated` GPUs are not real hardware."""

    index: int
    name: str
    uuid: str
    memory_total_mb: int
    simulated: bool


class GpuProcess(msgspec.Struct, frozen=True, kw_only=True):
    """A process holding memory on a GPU, and the task it belongs to ('' if none of ours)."""

    pid: int
    memory_mb: int
    task_id: str = ""
    attempt: int = 0


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of one GPU (every heartbeat). `simulated` readings are modelled from what
    the node's tasks do, not measured on hardware."""

    index: int
    utilization_pct: float
    memory_used_mb: int
    temperature_c: float
    power_w: float | None = None
    memory_total_mb: int = 0
    power_limit_w: float | None = None
    throttle: tuple[str, ...] = ()  # "thermal", "power" (clocks held down, and why)
    energy_j: float | None = None  # total since the driver loaded (NVML) or the agent started
    processes: tuple[GpuProcess, ...] = ()
    simulated: bool = False


class TaskHolding(msgspec.Struct, frozen=True, kw_only=True):
    """What a running task holds on its node, as the node reports it."""

    task_id: str
    attempt: int
    gpu_ids: tuple[int, ...] = ()
    gpu_share: float = 0.0
    paused: bool = False


def per_gpu_share(gpu_ids: Sequence[int], gpu_share: float) -> float:
    """The share of each listed GPU a task holds.

    `gpu_share` is a fraction (0.1-1.0) of each GPU, or — as in `Resources.gpus` — the
    number of whole GPUs; 0 with GPUs listed means whole GPUs.
    """
    if not gpu_ids:
        return 0.0
    if gpu_share <= 0:
        return 1.0
    if gpu_share > 1:
        return min(1.0, gpu_share / len(gpu_ids))
    return gpu_share


class Fence(msgspec.Struct, frozen=True, kw_only=True):
    """The current assignment of a task: only this attempt, on this node, may run it or
    write its checkpoints. Written by the scheduler with compare-and-set, attempts only grow."""

    task_id: str
    attempt: int
    node_id: str
    at: float


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a node-agent registered, plus its liveness; kept in the nodes KV bucket."""

    node_id: str
    hostname: str
    backend: GpuBackend
    gpus: tuple[GpuInfo, ...]
    cpu_slots: int
    registered_at: float
    last_heartbeat: float
    state: Literal["up", "stopping", "stopped"] = "up"  # stopping: takes no new work
    pid: int = 0
    version: str = ""
    incarnation: str = ""  # new for every agent start
    seq: int = 0  # renewal number within the incarnation
    samples: tuple[GpuSample, ...] = ()  # the latest telemetry
    holdings: tuple[TaskHolding, ...] = ()
    cgroups: bool = False  # CPU/memory limits enforced through cgroup v2
    mps: bool = False  # a CUDA MPS daemon shares the GPUs
    metrics_address: str = ""  # Prometheus /metrics, host:port
    platform: Platform = Platform()  # driver, CUDA and NVML versions ("" unknown)


class ServiceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A running service instance, registered in KV so others can find its gRPC address."""

    name: str
    instance: str
    grpc_address: str
    pid: int
    host: str
    started_at: float
    version: str = ""
    metrics_address: str = ""  # Prometheus /metrics, host:port ("" : none)
    http_address: str = ""  # a web page it serves (the report's dashboard), host:port
