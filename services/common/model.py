"""Domain types shared by the services: runs, steps, resources, nodes and GPUs.

These are the shapes on the bus, in KV and in the cores. Protobuf types never get past
the gRPC edge (see `m27.common.proto`). Schema evolution: add fields with defaults only.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

StepType = Literal["cpu", "gpu", "gpu_light"]
StepState = Literal[
    "pending", "queued", "running", "succeeded", "failed", "cancelled", "skipped"
]
RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Urgency = Literal["low", "normal", "high", "urgent"]
GpuBackend = Literal["nvml", "simulated", "none"]

STEP_TYPES: Final[tuple[StepType, ...]] = ("cpu", "gpu", "gpu_light")
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

    @property
    def gpu_tenths(self) -> int:
        """The GPU request in tenths of one GPU (a whole GPU is 10)."""
        return round(self.gpus * TENTHS_PER_GPU)


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a run: its definition and where it is in its life."""

    name: str
    type: StepType
    command: str
    depends_on: tuple[str, ...] = ()
    output: str | None = None
    checkpoint_interval_s: float | None = None
    resources: Resources = Resources()
    state: StepState = "pending"
    attempt: int = 0
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

    def step(self, name: str) -> StepRecord | None:
        return next((s for s in self.steps if s.name == name), None)


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU as its node registered it. `simulated` GPUs are not real hardware."""

    index: int
    name: str
    uuid: str
    memory_total_mb: int
    simulated: bool


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of one GPU (every heartbeat)."""

    index: int
    utilization_pct: float
    memory_used_mb: int
    temperature_c: float
    power_w: float | None = None


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a node-agent registered, plus its liveness; kept in the nodes KV bucket."""

    node_id: str
    hostname: str
    backend: GpuBackend
    gpus: tuple[GpuInfo, ...]
    cpu_slots: int
    registered_at: float
    last_heartbeat: float
    state: Literal["up", "stopped"] = "up"
    pid: int = 0
    version: str = ""


class ServiceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A running service instance, registered in KV so others can find its gRPC address."""

    name: str
    instance: str
    grpc_address: str
    pid: int
    host: str
    started_at: float
    version: str = ""
