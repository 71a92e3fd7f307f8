"""What the scheduler stores, and how it becomes the policy's input (pure).

The tasks bucket holds one `TaskEntry` per task the scheduler is responsible for; the
maintenance bucket one `Maintenance` per cordoned or draining node. From them, the nodes
bucket and the latest heartbeats, `cluster_state` and `queue_of` build the `ClusterState`
and the queue that `policy.decide` reads. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from m27.common.config import Config, parse_map
from m27.common.errors import ConfigError, NotFoundError
from m27.common.events import EnqueueTask
from m27.common.model import GpuSample, NodeInfo
from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Gpu,
    Job,
    Node,
    PolicySettings,
    Queued,
    Running,
    Tier,
)

MaintenanceState = Literal["cordoned", "draining"]


class UnknownNode(NotFoundError):
    """Maintenance asked for a node that never registered."""


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Capacity a task holds: `gpu_milli` on each of its GPUs, and CPU slots. (The
    orchestrator's node view reads `node_id` and `cpus` from the stored entry.)"""

    task_id: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...]
    gpu_milli: int = 0
    cpus: int = 1
    lender: str = ""  # started into this running task's idle capacity (backfill)


class TaskEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One task the scheduler is responsible for, as stored in the tasks bucket."""

    task: EnqueueTask
    queued_at: float  # first entry into the queue: kept across preemptions
    attained_gpu_s: float = 0.0  # GPU-seconds held by earlier attempts
    placement: Placement | None = None
    placed_at: float = 0.0
    started: bool = False
    started_at: float | None = None
    wait_reason: str = ""
    idle: bool = False  # the agent reported its GPU share idle (task_idle)
    paused: bool = False  # a PauseTask was sent (and no ResumeTask since)
    paused_at: float | None = None
    signals: int = 0  # pause/resume commands sent: each gets its own message id
    stopping: str = ""  # the reason of the stop already sent (preemption, drain)
    #: The queued task that stop was sent for ("" for a drain): while this one stops, its
    #: capacity is counted for that task only (`Running.stopping_for`).
    stopping_for: str = ""
    # (Renamed from the single-node `staging_on`/`staged_on`: an entry stored by an older
    # scheduler decodes with its unknown old fields ignored, and is staged again.)
    #: ready pool: nodes sent a StageTask that have not answered `task_staged` yet
    staging_nodes: tuple[str, ...] = ()
    staged_nodes: tuple[str, ...] = ()  # ready pool: nodes that read its inputs ahead
    last_checkpoint_at: float | None = None  # this attempt's latest checkpoint_committed


class Maintenance(msgspec.Struct, frozen=True, kw_only=True):
    """A node taken out of service by `m27 node cordon|drain`, stored in its own bucket."""

    node_id: str
    state: MaintenanceState
    reason: str = ""
    at: float = 0.0
    #: Draining for a maintenance window: every task leaves, not only checkpointing ones.
    evacuate: bool = False


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """A registered node and whether the scheduler currently counts it as alive."""

    info: NodeInfo
    alive: bool


# ---------------------------------------------------------------- settings


def policy_settings(config: Config) -> PolicySettings:
    """The `[scheduler]` section (and `[performance] memory_overprovision`) as the policy's
    settings. Raises ConfigError for a malformed map."""
    try:
        return _settings(config)
    except ValueError as exc:
        raise ConfigError(f"[scheduler] weights and levels: {exc}") from exc


def _settings(config: Config) -> PolicySettings:
    section = config.scheduler
    return PolicySettings(
        urgency_weight={k: float(v) for k, v in parse_map(section.urgency_weights).items()},
        user_levels=parse_map(section.user_levels),
        level_weight={k: float(v) for k, v in parse_map(section.level_weights).items()},
        default_level=section.default_level, aging_per_hour=section.aging_per_hour,
        held_per_gpu_hour=section.held_per_gpu_hour,
        memory_overprovision=config.performance.memory_overprovision,
        max_temperature_c=section.max_temperature, min_runtime_s=section.min_runtime,
        preempt_grace_s=section.preempt_grace, preemption=section.preemption,
        max_fruitless_preemptions=section.max_fruitless_preemptions,
        backfill=section.backfill, ready_pool=section.ready_pool,
        stage_nodes=section.stage_nodes, backfill_pool=section.backfill_pool,
        max_pause_s=section.max_pause, peer_yield_gpu_h=section.peer_yield_gpu_hours)


# ---------------------------------------------------------------- policy input


def tier_of(task: EnqueueTask) -> Tier:
    """Low-priority preemptible work (preprocessing, sweeps) is the background tier."""
    return "background" if task.urgency == "low" and task.preemptible else "immediate"


def job_of(task: EnqueueTask) -> Job:
    resources = task.resources
    return Job(task_id=task.task_id, attempt=task.attempt,
               gpu_milli=round(resources.gpus * MILLI_PER_GPU),
               gpu_memory_mb=resources.gpu_memory_mb, cpu_milli=resources.cpus * 1000,
               memory_mb=resources.memory_mb, urgency=task.urgency, user=task.user,
               preemptible=task.preemptible, tier=tier_of(task),
               checkpoints=task.checkpoint_interval_s is not None or task.preemptible,
               fruitless_preemptions=task.fruitless_preemptions,
               gpu_model=resources.gpu_model, driver=resources.driver, cuda=resources.cuda,
               timeout_s=task.timeout_s)


def _gpu(info: NodeInfo, index: int, memory_mb: int, simulated: bool, model: str) -> Gpu:
    sample: GpuSample | None = next((s for s in info.samples if s.index == index), None)
    if sample is None:
        return Gpu(index=index, memory_mb=memory_mb, model=model, simulated=simulated)
    return Gpu(index=index, memory_mb=memory_mb, model=model, simulated=simulated,
               temperature_c=sample.temperature_c, throttled=sample.throttle,
               utilization_pct=sample.utilization_pct)


def node_of(view: NodeView, maintenance: Maintenance | None,
            window_in_s: float | None = None) -> Node:
    """Takes new work only when up, alive and not in maintenance; `window_in_s`: its
    maintenance window is that near (m27.scheduler._windows.window_in_s)."""
    info = view.info
    gpus = tuple(_gpu(info, g.index, g.memory_total_mb, g.simulated, g.name)
                 for g in info.gpus)
    schedulable = view.alive and info.state == "up" and maintenance is None
    return Node(node_id=info.node_id, gpus=gpus, cpu_milli=info.cpu_slots * 1000,
                schedulable=schedulable,
                draining=maintenance is not None and maintenance.state == "draining",
                platform=info.platform, window_in_s=window_in_s,
                evacuating=maintenance is not None and maintenance.evacuate)


def running_of(entry: TaskEntry) -> Running | None:
    placement = entry.placement
    if placement is None:
        return None
    started = entry.started_at if entry.started_at is not None else entry.placed_at
    return Running(job=job_of(entry.task), node_id=placement.node_id,
                   gpu_ids=placement.gpu_ids, gpu_milli=placement.gpu_milli,
                   started_at=started, queued_at=entry.queued_at,
                   attained_gpu_s=entry.attained_gpu_s, idle=entry.idle, paused=entry.paused,
                   lender=placement.lender, stopping=bool(entry.stopping),
                   stopping_for=entry.stopping_for if entry.stopping else "",
                   paused_at=entry.paused_at if entry.paused else None,
                   last_checkpoint_at=entry.last_checkpoint_at,
                   # Placed but not started yet: the agent is still preparing the attempt
                   # (restoring its checkpoint files), so it is not preempted yet.
                   staging=not entry.started, computing_since=entry.started_at)


def cluster_state(nodes: Iterable[NodeView], maintenance: Mapping[str, Maintenance],
                  entries: Iterable[TaskEntry],
                  windows: Mapping[str, float] | None = None) -> ClusterState:
    """Nodes sorted by id and running tasks by task id: the same input, the same decisions.
    `windows`: node → seconds until its maintenance window, where that is within its lead."""
    near = windows or {}
    return ClusterState(
        nodes=tuple(node_of(v, maintenance.get(v.info.node_id), near.get(v.info.node_id))
                    for v in sorted(nodes, key=lambda v: v.info.node_id)),
        running=tuple(r for e in sorted(entries, key=lambda e: e.task.task_id)
                      if (r := running_of(e)) is not None))


def queue_of(entries: Iterable[TaskEntry], now: float) -> list[Queued]:
    """Unplaced tasks past their retry backoff, oldest first."""
    waiting = [e for e in entries if e.placement is None and e.task.not_before <= now]
    return [Queued(job=job_of(e.task), queued_at=e.queued_at,
                   attained_gpu_s=e.attained_gpu_s, staged_on=e.staged_nodes)
            for e in sorted(waiting, key=lambda e: (e.queued_at, e.task.task_id))]


def attempt_gpu_s(entry: TaskEntry, now: float) -> float:
    """GPU-seconds the current attempt has held so far."""
    placement = entry.placement
    if placement is None or entry.started_at is None:
        return 0.0
    return max(0.0, now - entry.started_at) * placement.gpu_milli * len(
        placement.gpu_ids) / MILLI_PER_GPU
