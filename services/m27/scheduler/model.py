"""What the scheduling policy sees and decides (pure data), shared by the policy core, the
scheduler service (which builds it from KV records, heartbeats and task events) and the
simulator (which builds it in virtual time). Nothing here does I/O.

Capacity is counted in thousandths of a GPU ("milli", as Kubernetes GPU-sharing and the
Alibaba openb trace do): a request below 1000 is a share of one GPU, a multiple of 1000 is
that many whole GPUs gang-placed on one node. The pipeline language asks in tenths (0.1 =
100 milli). CPU is counted in milli-cores, memory in MiB.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Literal

import msgspec

from m27.common.model import Urgency
from m27.common.platform import Platform

MILLI_PER_GPU: Final = 1000
#: immediate: normal work, ordered by score. background: low-priority, preemptible filler
#: (preprocessing, sweeps) that only takes leftovers and idle capacity.
Tier = Literal["immediate", "background"]


class Gpu(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    memory_mb: int  # total
    model: str = ""  # e.g. "V100M16", for trace constraints (`gpu_spec`)
    temperature_c: float | None = None  # latest reading; None: not known (yet)
    throttled: tuple[str, ...] = ()  # "thermal", "power": clocks held down now
    utilization_pct: float | None = None
    simulated: bool = False


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    gpus: tuple[Gpu, ...]
    cpu_milli: int
    memory_mb: int = 0  # 0: not tracked (no memory limit in placement)
    #: False: takes no new work (cordoned, draining, stopping, lost).
    schedulable: bool = True
    #: Its running work is to be checkpointed and moved off (`m27 node drain`).
    draining: bool = False
    platform: Platform = Platform()  # driver and CUDA versions, for requirements
    #: Its maintenance window starts in this many seconds (0: it is on); None: none within
    #: the window's lead. New work must end or checkpoint before it (m27.common.windows).
    window_in_s: float | None = None
    #: Draining for a maintenance window: all its work stops, not only what checkpoints.
    evacuating: bool = False


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A task as the policy sees it (queued or running)."""

    task_id: str
    attempt: int = 1
    gpu_milli: int = 0  # < 1000: a share of one GPU; k * 1000: k whole GPUs on one node
    gpu_memory_mb: int = 0  # 0: the share's proportion of the GPU's memory
    cpu_milli: int = 1000
    memory_mb: int = 0
    urgency: Urgency = "normal"
    user: str = ""
    preemptible: bool = False
    tier: Tier = "immediate"
    #: Only GPUs of these models ("A100|H100", matched by words: m27.common.platform);
    #: "" any. Also a trace's `gpu_spec`.
    gpu_model: str = ""
    driver: str = ""  # a driver version requirement (">=535"); "" none
    cuda: str = ""  # a CUDA version requirement (">=12.1"); "" none
    timeout_s: float | None = None  # its time limit: it ends by then (maintenance windows)
    #: The task saves checkpoints (a `checkpoint:` interval or m27.train): a stop loses
    #: little, so it is a cheap preemption victim and can be moved off a draining node.
    checkpoints: bool = False
    #: Consecutive earlier attempts that were preempted before they made durable progress
    #: (no checkpoint committed in the attempt); a preemption after progress resets it.
    #: At `PolicySettings.max_fruitless_preemptions` the task is not preempted again until
    #: its current attempt makes progress.
    fruitless_preemptions: int = 0


class Queued(msgspec.Struct, frozen=True, kw_only=True):
    job: Job
    queued_at: float  # when it (first) entered the queue; a preempted task keeps it
    #: GPU-seconds the task (all its attempts) has held so far: least-attained-service
    #: policies and "long holders yield".
    attained_gpu_s: float = 0.0
    #: Nodes its inputs are staged on (ready pool): starting on one of them is instant.
    staged_on: tuple[str, ...] = ()


class Running(msgspec.Struct, frozen=True, kw_only=True):
    job: Job
    node_id: str
    gpu_ids: tuple[int, ...]
    gpu_milli: int  # on each of gpu_ids
    started_at: float  # this attempt
    queued_at: float = 0.0  # as in Queued: kept across preemptions
    attained_gpu_s: float = 0.0  # before this attempt
    last_checkpoint_at: float | None = None
    #: The agent reports its GPU share idle (I/O wait) for N consecutive samples.
    idle: bool = False
    paused: bool = False  # SIGSTOPped (a backfill whose lender is busy again)
    #: Started into the idle capacity of this running task (backfill); "" otherwise.
    lender: str = ""
    stopping: bool = False  # a stop (preemption, drain) was already sent
    #: When it was paused (SIGSTOP); None: not paused or not known. A paused backfill is a
    #: preemption victim only once paused longer than `PolicySettings.max_pause_s`.
    paused_at: float | None = None
    #: The queued task the stop was sent for ("" for a drain, a timer or not known): its
    #: capacity is counted for that task only while it stops.
    stopping_for: str = ""
    #: Still copying its inputs (staging): never preempted, its minimum runtime not begun.
    staging: bool = False
    #: When this attempt began computing (its staging done); None: at `started_at`.
    computing_since: float | None = None


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    nodes: tuple[Node, ...]
    running: tuple[Running, ...]


class PolicySettings(msgspec.Struct, frozen=True, kw_only=True):
    """The `[scheduler]` knobs the policy reads (docs/scheduling.md has the formula)."""

    urgency_weight: dict[str, float] = msgspec.field(default_factory=lambda: {
        "low": 0.0, "normal": 100.0, "high": 200.0, "urgent": 400.0})
    #: user → level, and level → weight (e.g. student / staff / pi)
    user_levels: dict[str, str] = msgspec.field(default_factory=dict)
    level_weight: dict[str, float] = msgspec.field(default_factory=lambda: {
        "student": 0.0, "staff": 20.0, "pi": 40.0})
    default_level: str = "student"
    aging_per_hour: float = 25.0  # score gained per hour waiting: nothing starves
    held_per_gpu_hour: float = 5.0  # score lost per GPU-hour already held: long holders yield
    memory_overprovision: float = 1.0  # GPU memory overcommit for fractional packing
    max_temperature_c: float = 80.0  # hotter GPUs (or throttling ones) get no new work
    #: A task computing for less than this in its attempt is not preempted, whatever its
    #: tier (no thrash); nor is one still staging its inputs.
    min_runtime_s: float = 300.0
    #: A task whose last this-many attempts were all preempted before they made durable
    #: progress is not preempted again until its current attempt commits a checkpoint.
    max_fruitless_preemptions: int = 3
    preempt_grace_s: float = 60.0  # checkpoint-then-stop: SIGTERM, SIGKILL after this
    preemption: bool = True
    backfill: bool = True  # start work in GPU capacity its holder leaves idle (I/O wait)
    ready_pool: int = 2  # how many next tasks get their inputs staged while they wait
    #: On how many of the nodes that could hold it a ready-pool task is staged (the ones
    #: with the most free capacity of its kind first): it starts warm wherever capacity
    #: frees first among them. Each node reads its inputs once; 1 stages on one node only.
    stage_nodes: int = 4
    #: How many next waiting background tasks of each GPU share asked (one GPU or less;
    #: at most 4 × this in all) get their inputs staged where idle shares they fit are
    #: lent (up to `stage_nodes` nodes each), so a backfill computes in the idle share it
    #: is lent instead of copying its inputs there.
    backfill_pool: int = 4
    #: A paused backfill is expected to resume at its lender's next I/O wait: only once
    #: paused longer than this may a waiting task preempt it for the memory it holds.
    max_pause_s: float = 600.0
    #: Least-attained-service among peers (as Tiresias): a task that has held less than
    #: this many GPU-hours may preempt a preemptible task of its own class that has held at
    #: least that many, if its score is higher. 0: only lower classes are preempted.
    peer_yield_gpu_h: float = 4.0


class Place(msgspec.Struct, frozen=True, kw_only=True, tag="place"):
    task_id: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...]
    gpu_milli: int  # on each of gpu_ids
    reason: str
    lender: str = ""  # a backfill into this running task's idle capacity


class Wait(msgspec.Struct, frozen=True, kw_only=True, tag="wait"):
    task_id: str
    reason: str  # e.g. "needs 0.5 GPU with 12 GiB; largest free slice is 0.3"


class Preempt(msgspec.Struct, frozen=True, kw_only=True, tag="preempt"):
    """Checkpoint-then-stop a running task (SIGTERM, SIGKILL after `grace_s`); it is
    requeued with its priority and `queued_at` intact and resumes from its checkpoint."""

    task_id: str
    attempt: int
    reason: str
    grace_s: float
    for_task: str = ""  # the task it makes room for ("" for a drain)


class Pause(msgspec.Struct, frozen=True, kw_only=True, tag="pause"):
    task_id: str
    attempt: int
    reason: str


class Resume(msgspec.Struct, frozen=True, kw_only=True, tag="resume"):
    task_id: str
    attempt: int
    reason: str


class Stage(msgspec.Struct, frozen=True, kw_only=True, tag="stage"):
    """Ready pool: copy this queued task's inputs to the node it will most likely start on."""

    task_id: str
    node_id: str
    reason: str


Decision = Place | Wait | Preempt | Pause | Resume | Stage
#: A scheduling policy: m27's, or a baseline in the simulator. Pure and deterministic.
Policy = Callable[[ClusterState, Sequence[Queued], float], list[Decision]]
