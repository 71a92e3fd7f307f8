"""Baseline policies, each a `Policy` the simulator drives exactly like m27's own.

- `fifo`: automated first-come-first-served on whole GPUs (a share is rounded up to a whole
  GPU); the head of the queue blocks everyone behind it.
- `best_fit`: urgency then age; a share goes onto the GPU it fills most tightly, a gang onto
  the node with the fewest free GPUs that still fit it; nobody blocks.
- `slurm_backfill`: Slurm-like multifactor priority (urgency + age) on whole GPUs with EASY
  backfill: the top job that cannot start gets a reservation at the earliest time its node
  frees enough GPUs (from the running jobs' time limits); a later job may start now if it
  fits and ends before that time, or runs on another node.
- `tiresias`: Tiresias-like discretized two-queue least-attained-service on whole GPUs: jobs
  that have held less than `threshold_gpu_s` go first; a job of the first queue that cannot
  start preempts jobs of the second queue (checkpoint-then-stop with a grace period).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Decision,
    Job,
    Place,
    Policy,
    Preempt,
    Queued,
    Running,
    Wait,
)
from m27.sim._capacity import FreeMap, demand_milli, gpus_needed

URGENCY_RANK: Final = {"low": 0, "normal": 1, "high": 2, "urgent": 3}
DEFAULT_LIMIT_S: Final = 24 * 3600.0


def whole_gpu_place(free: FreeMap, q: Queued, *, pack: bool, reason: str,
                    avoid: str = "") -> Place | None:
    """Whole free GPUs on one node for `q` (a share gets a whole GPU), or None."""
    job = q.job
    need = gpus_needed(job)
    if need and free.max_free() < MILLI_PER_GPU:
        return None
    best: tuple[int, str, tuple[int, ...]] | None = None
    for node_id in free.nodes:
        if node_id == avoid or not free.cpu_fits(job, node_id):
            continue
        gpus = tuple(free.free_gpus(job, node_id, MILLI_PER_GPU))
        if len(gpus) < need:
            continue
        key = (len(gpus) if pack else 0, node_id, gpus[:need])
        if best is None or key[0] < best[0]:
            best = key
            if not pack:
                break
    if best is None:
        return None
    place = Place(task_id=job.task_id, attempt=job.attempt, node_id=best[1],
                  gpu_ids=best[2], gpu_milli=MILLI_PER_GPU if need else 0, reason=reason)
    free.take(job, place.node_id, place.gpu_ids, place.gpu_milli)
    return place


def fifo(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
    """First come, first served on whole GPUs; the head blocks the rest."""
    free = FreeMap(state)
    out: list[Decision] = []
    for q in sorted(queue, key=lambda q: (q.queued_at, q.job.task_id)):
        place = whole_gpu_place(free, q, pack=False, reason="fifo: next in line")
        if place is None:
            out.append(Wait(task_id=q.job.task_id, reason="fifo: waits for whole GPUs"))
            break
        out.append(place)
    return out


def _order(q: Queued) -> tuple[int, float, str]:
    return (-URGENCY_RANK[q.job.urgency], q.queued_at, q.job.task_id)


def _tightest_share(free: FreeMap, job: Job) -> tuple[str, int] | None:
    milli = demand_milli(job)
    if free.max_free() < milli:
        return None
    best: tuple[int, str, int] | None = None
    for node_id in free.nodes:
        if not free.cpu_fits(job, node_id):
            continue
        for index in free.free_gpus(job, node_id, milli):
            left = free.milli[node_id, index] - milli
            if best is None or left < best[0]:
                best = (left, node_id, index)
    return None if best is None else (best[1], best[2])


def best_fit(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
    """Pack shares tightly, gangs onto the fullest node that fits; nobody blocks."""
    free = FreeMap(state)
    out: list[Decision] = []
    for q in sorted(queue, key=_order):
        job = q.job
        place: Place | None
        if 0 < job.gpu_milli < MILLI_PER_GPU:
            spot = _tightest_share(free, job)
            place = None if spot is None else Place(
                task_id=job.task_id, attempt=job.attempt, node_id=spot[0], gpu_ids=(spot[1],),
                gpu_milli=job.gpu_milli, reason="best-fit: tightest GPU share")
            if place is not None:
                free.take(job, place.node_id, place.gpu_ids, place.gpu_milli)
        else:
            place = whole_gpu_place(free, q, pack=True, reason="best-fit: fullest node")
        out.append(place or Wait(task_id=job.task_id, reason="best-fit: does not fit"))
    return out


def slurm_backfill(limits: Mapping[str, float], *, age_weight_per_h: float = 10.0,
                   urgency_weight: float = 100.0) -> Policy:
    """Slurm-like priority + EASY backfill; `limits` are the jobs' time limits (seconds)."""

    def limit(job: Job) -> float:
        return limits.get(job.task_id, DEFAULT_LIMIT_S)

    def priority(q: Queued, now: float) -> tuple[float, float, str]:
        score = URGENCY_RANK[q.job.urgency] * urgency_weight
        score += age_weight_per_h * (now - q.queued_at) / 3600.0
        return (-score, q.queued_at, q.job.task_id)

    def policy(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
        free = FreeMap(state)
        out: list[Decision] = []
        shadow: tuple[str, float] | None = None  # the reserved node and its start time
        for q in sorted(queue, key=lambda q: priority(q, now)):
            if shadow is None:
                place = whole_gpu_place(free, q, pack=True, reason="slurm: top priority")
                if place is None:
                    shadow = _reservation(state, free, q.job, limit, now)
                    out.append(Wait(task_id=q.job.task_id, reason="slurm: reserved"))
                    continue
            else:
                fits_before = now + limit(q.job) <= shadow[1]
                place = whole_gpu_place(free, q, pack=True, reason="slurm: backfill",
                                        avoid="" if fits_before else shadow[0])
            out.append(place or Wait(task_id=q.job.task_id, reason="slurm: no backfill slot"))
        return out

    return policy


def _reservation(state: ClusterState, free: FreeMap, job: Job,
                 limit: Callable[[Job], float], now: float) -> tuple[str, float]:
    """The node that frees `job`'s GPUs soonest, and when (running jobs end at their limit)."""
    need = gpus_needed(job)
    best = ("", float("inf"))
    for node_id in free.nodes:
        have = len(tuple(free.free_gpus(job, node_id, MILLI_PER_GPU)))
        ends = sorted((r.started_at + limit(r.job), len(r.gpu_ids)) for r in state.running
                      if r.node_id == node_id and r.gpu_ids and not r.lender)
        at = now
        for end, count in ends:
            if have >= need:
                break
            have, at = have + count, max(now, end)
        if have >= need and at < best[1]:
            best = (node_id, at)
    return best


def tiresias(*, threshold_gpu_s: float = 3600.0, grace_s: float = 60.0,
             min_runtime_s: float = 300.0) -> Policy:
    """Discretized 2-queue least-attained-service, preemptive, on whole GPUs."""

    def attained(r: Running, now: float) -> float:
        return r.attained_gpu_s + r.gpu_milli * len(r.gpu_ids) / MILLI_PER_GPU * (
            now - r.started_at)

    def policy(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
        free = FreeMap(state)
        out: list[Decision] = []
        victims = sorted(
            (r for r in state.running if r.gpu_ids and not r.stopping
             and attained(r, now) >= threshold_gpu_s and now - r.started_at >= min_runtime_s),
            key=lambda r: -attained(r, now))
        soon: dict[str, int] = {}  # GPUs that preempted jobs are about to free, per node
        for r in state.running:
            if r.stopping and r.gpu_ids:
                soon[r.node_id] = soon.get(r.node_id, 0) + len(r.gpu_ids)
        order = sorted(queue, key=lambda q: (q.attained_gpu_s >= threshold_gpu_s,
                                             q.queued_at, q.job.task_id))
        for q in order:
            place = whole_gpu_place(free, q, pack=True, reason="tiresias: least attained")
            if place is not None:
                out.append(place)
                continue
            if q.attained_gpu_s < threshold_gpu_s and victims:
                out.extend(_preempt_for(q.job, free, victims, soon, grace_s))
            out.append(Wait(task_id=q.job.task_id, reason="tiresias: no free GPUs"))
        return out

    return policy


def _preempt_for(job: Job, free: FreeMap, victims: list[Running], soon: dict[str, int],
                 grace_s: float) -> list[Decision]:
    """Stop the most-served victims on one node until `job` would fit there; nothing when
    GPUs already being freed there suffice (they are claimed for it)."""
    need = gpus_needed(job)
    for node_id in free.nodes:
        have = len(tuple(free.free_gpus(job, node_id, MILLI_PER_GPU)))
        if have + soon.get(node_id, 0) >= need:
            soon[node_id] = soon.get(node_id, 0) - max(0, need - have)
            return []
        have += soon.get(node_id, 0)
        chosen: list[Running] = []
        for victim in (v for v in victims if v.node_id == node_id):
            if have >= need:
                break
            chosen.append(victim)
            have += len(victim.gpu_ids)
        if have >= need and chosen:
            soon[node_id] = 0  # what was being freed there goes to this job too
            for victim in chosen:
                victims.remove(victim)
            return [Preempt(task_id=v.job.task_id, attempt=v.job.attempt, grace_s=grace_s,
                            for_task=job.task_id, reason="tiresias: most attained service")
                    for v in chosen]
    return []
