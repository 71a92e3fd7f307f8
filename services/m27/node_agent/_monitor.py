"""What the node's telemetry means, decided as data: idle tasks, tasks over their GPU memory
share, the energy each task used, and GPU memory leaked by tasks that ended.

Pure: the watchers keep a little state between samples but do no I/O and read no clock; the
telemetry shell (`_telemetry`) feeds them each sample and applies their decisions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from m27.common.model import GpuSample

TaskKey = tuple[str, int]
Phase = Literal["io", "compute", ""]
OverSharePolicy = Literal["stop", "warn"]
#: A leak is reported once it was seen on this many samples in a row: a process that just
#: ended may still be listed while its GPU context is torn down.
LEAK_CONFIRM_SAMPLES: Final = 2


@dataclass(frozen=True, slots=True)
class TaskSample:
    """One running task as one sample saw it."""

    key: TaskKey
    gpu_ids: tuple[int, ...]
    share: float  # of each listed GPU
    utilization_pct: float | None  # % of its own share kept busy; None: not measured
    phase: Phase = ""  # reported by the training library ("" if it reports nothing)
    paused: bool = False
    memory_mb: Mapping[int, int] = field(default_factory=dict)  # GPU → what it holds there
    limit_mb: Mapping[int, int] = field(default_factory=dict)  # GPU → what it may hold


# ---------------------------------------------------------------- idle (I/O stall)


@dataclass(frozen=True, slots=True)
class IdleDecision:
    """A task left its GPU share idle (`idle`), or uses it again (not `idle`)."""

    key: TaskKey
    idle: bool
    gpu_ids: tuple[int, ...]
    idle_share: float
    utilization_pct: float
    reason: str  # "gpu_idle" | "io_phase" | "busy"


@dataclass(slots=True)
class _IdleState:
    low: int = 0
    idle: bool = False


class IdleDetector:
    """Idle after `samples` samples in a row under `threshold_pct` (or at once when the task
    reports an I/O phase); busy again at the first sample at or over it outside an I/O
    phase. Each change is decided once. Paused tasks and tasks without GPUs are not
    watched; a sample without a utilization neither counts nor resets."""

    def __init__(self, threshold_pct: float, samples: int) -> None:
        self._threshold = threshold_pct
        self._samples = max(1, samples)
        self._state: dict[TaskKey, _IdleState] = {}

    def observe(self, task: TaskSample) -> IdleDecision | None:
        if not task.gpu_ids:
            return None
        state = self._state.setdefault(task.key, _IdleState())
        if task.paused:
            state.low = 0  # stopped by the agent, not stalled: measure afresh after resume
            return None
        util = task.utilization_pct
        if util is not None:
            state.low = state.low + 1 if util < self._threshold else 0
        io = task.phase == "io"
        if io:  # reported idle: it is busy again once its utilization shows it
            state.low = max(state.low, self._samples)
        idle = state.low >= self._samples
        if idle == state.idle:
            return None
        state.idle = idle
        reason = ("io_phase" if io else "gpu_idle") if idle else "busy"
        return IdleDecision(key=task.key, idle=idle, gpu_ids=task.gpu_ids,
                            idle_share=task.share if idle else 0.0,
                            utilization_pct=util if util is not None else 0.0, reason=reason)

    def forget(self, key: TaskKey) -> None:
        self._state.pop(key, None)


# ---------------------------------------------------------------- over its memory share


def memory_limit_mb(gpu_total_mb: int, share: float, gpu_memory_mb: int, gpu_count: int,
                    overprovision: float) -> int:
    """What a task may hold on each of its GPUs: its `gpu_memory` request divided over its
    GPUs, else its share of the GPU; times `[performance] memory_overprovision`."""
    base = gpu_memory_mb / max(1, gpu_count) if gpu_memory_mb > 0 else gpu_total_mb * share
    return int(base * overprovision)


@dataclass(frozen=True, slots=True)
class OverShareDecision:
    key: TaskKey
    gpu_index: int
    used_mb: int
    limit_mb: int
    action: Literal["warned", "stopped"]
    reason: str


@dataclass(slots=True)
class _OverState:
    over: int = 0
    warned: bool = False
    stopped: bool = False


class OverShareWatch:
    """A task on a GPU share holding more memory than its limit: warned on the first sample
    over (again after it came back under), stopped after `samples` samples over in a row
    unless the policy is `warn`. Whole-GPU tasks crowd no one and are not watched."""

    def __init__(self, policy: OverSharePolicy, samples: int) -> None:
        self._policy = policy
        self._samples = max(1, samples)
        self._state: dict[TaskKey, _OverState] = {}

    def observe(self, task: TaskSample) -> list[OverShareDecision]:
        if task.share >= 1.0 or not task.gpu_ids:
            return []
        over = [(task.memory_mb.get(g, 0) - limit, g, limit)
                for g, limit in task.limit_mb.items()
                if limit > 0 and task.memory_mb.get(g, 0) > limit]
        state = self._state.setdefault(task.key, _OverState())
        if not over:
            state.over, state.warned = 0, False
            return []
        state.over += 1
        _excess, gpu, limit = max(over)
        used = task.memory_mb[gpu]
        decisions = []
        if not state.warned:
            state.warned = True
            decisions.append(OverShareDecision(
                key=task.key, gpu_index=gpu, used_mb=used, limit_mb=limit, action="warned",
                reason=f"holds {used} MB on GPU {gpu}, over its share's {limit} MB"))
        if self._policy == "stop" and state.over >= self._samples and not state.stopped:
            state.stopped = True
            decisions.append(OverShareDecision(
                key=task.key, gpu_index=gpu, used_mb=used, limit_mb=limit, action="stopped",
                reason=f"held {used} MB on GPU {gpu}, over its share's {limit} MB, for "
                       f"{state.over} samples"))
        return decisions

    def forget(self, key: TaskKey) -> None:
        self._state.pop(key, None)


# ---------------------------------------------------------------- energy per task


@dataclass(frozen=True, slots=True)
class _GpuPoint:
    at: float
    energy_j: float | None
    power_w: float | None


def energy_delta_j(before: _GpuPoint, after: _GpuPoint) -> float | None:
    """A GPU's energy between two samples: from its energy counter, else power × time (the
    mean of both readings), else unknown. A counter that went back (driver reload) is not
    trusted."""
    if before.energy_j is not None and after.energy_j is not None \
            and after.energy_j >= before.energy_j:
        return after.energy_j - before.energy_j
    powers = [p for p in (before.power_w, after.power_w) if p is not None]
    if not powers:
        return None
    return sum(powers) / len(powers) * max(0.0, after.at - before.at)


class EnergyMeter:
    """Each task's energy: the sum over samples of its share of each of its GPUs times that
    GPU's energy since the previous sample. A task's last partial interval before it ends
    (at most one sample interval) is not counted."""

    def __init__(self) -> None:
        self._points: dict[int, _GpuPoint] = {}
        self._tasks: dict[TaskKey, float] = {}

    def add(self, samples: Sequence[GpuSample], tasks: Iterable[TaskSample],
            now: float) -> None:
        deltas: dict[int, float] = {}
        for sample in samples:
            point = _GpuPoint(at=now, energy_j=sample.energy_j, power_w=sample.power_w)
            before = self._points.get(sample.index)
            self._points[sample.index] = point
            delta = None if before is None else energy_delta_j(before, point)
            if delta is not None:
                deltas[sample.index] = delta
        for task in tasks:
            used = [task.share * deltas[g] for g in task.gpu_ids if g in deltas]
            if used:
                self._tasks[task.key] = self._tasks.get(task.key, 0.0) + sum(used)

    def energy_j(self, key: TaskKey) -> float | None:
        """None: the task held no GPU whose energy could be measured."""
        total = self._tasks.get(key)
        return None if total is None else round(total, 3)

    def totals(self) -> dict[TaskKey, float]:
        return {k: round(v, 3) for k, v in self._tasks.items()}

    def forget(self, key: TaskKey) -> None:
        self._tasks.pop(key, None)


# ---------------------------------------------------------------- leaked GPU memory


@dataclass(frozen=True, slots=True)
class LeakDecision:
    """GPU memory held by processes of a task that is not running here any more."""

    gpu_index: int
    key: TaskKey
    pids: tuple[int, ...]
    memory_mb: int
    cleaned: bool  # safe to kill: this node's processes, of a task that ended here
    reason: str


def leak_candidates(samples: Sequence[GpuSample],
                    running: Collection[TaskKey]) -> dict[tuple[int, TaskKey], dict[int, int]]:
    """(GPU, task) → {pid: MB} of processes of tasks that are not running."""
    found: dict[tuple[int, TaskKey], dict[int, int]] = {}
    for sample in samples:
        for proc in sample.processes:
            key = (proc.task_id, proc.attempt)
            if proc.task_id and key not in running:
                found.setdefault((sample.index, key), {})[proc.pid] = proc.memory_mb
    return found


class LeakWatch:
    """Reports each leak once (after `LEAK_CONFIRM_SAMPLES` samples in a row), with whether
    it may be cleaned up: only if every process's environment names this node, the task
    ended here (`ended`), and none is pid 1 or the agent itself (`never`)."""

    def __init__(self, node_id: str, never: Collection[int],
                 confirm: int = LEAK_CONFIRM_SAMPLES) -> None:
        self._node_id = node_id
        self._never = frozenset(never) | {0, 1}
        self._confirm = max(1, confirm)
        self._seen: dict[tuple[int, TaskKey, tuple[int, ...]], int] = {}

    def observe(self, candidates: Mapping[tuple[int, TaskKey], Mapping[int, int]],
                ended: Collection[TaskKey],
                env_node: Mapping[int, str | None]) -> list[LeakDecision]:
        """`env_node`: pid → the M27_NODE_ID its environment carries (None: unreadable)."""
        seen: dict[tuple[int, TaskKey, tuple[int, ...]], int] = {}
        decisions = []
        for (gpu, key), held in sorted(candidates.items()):
            pids = tuple(sorted(held))
            ident = (gpu, key, pids)
            count = seen[ident] = self._seen.get(ident, 0) + 1
            if count != self._confirm:
                continue
            safe = key in ended and all(
                env_node.get(p) == self._node_id and p not in self._never for p in pids)
            why = "its task ended here" if key in ended else "its task is not running here"
            decisions.append(LeakDecision(
                gpu_index=gpu, key=key, pids=pids, memory_mb=sum(held.values()), cleaned=safe,
                reason=f"{len(pids)} process(es) of {key[0]} attempt {key[1]} hold GPU {gpu} "
                       f"memory; {why}" + ("" if safe else "; left alone: not provably ours")))
        self._seen = seen
        return decisions
