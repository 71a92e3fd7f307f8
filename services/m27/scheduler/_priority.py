"""Mixed priority (pure): one number per task, and its parts, so `--explain` can show why.

    score = urgency_weight[urgency] + level_weight[level(user)]
            + aging_per_hour * hours waited since queued_at
            - held_per_gpu_hour * GPU-hours already held (attained_gpu_s / 3600)

Aging makes every waiting task climb, so nothing starves; the held term makes long holders
yield to newcomers of the same class. A running task's aging stops when it starts.
docs/scheduling.md has the worked formula.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from m27.scheduler.model import Job, PolicySettings, Queued, Running


class Score(msgspec.Struct, frozen=True, kw_only=True):
    """A task's score and the terms it is the sum of."""

    total: float
    urgency: float
    level: float
    aging: float
    held: float  # subtracted: the penalty, as a positive number
    user_level: str


def score(job: Job, queued_at: float, attained_gpu_s: float, now: float,
          settings: PolicySettings) -> Score:
    """The score of a task that entered the queue at `queued_at` and held GPUs so long."""
    level = settings.user_levels.get(job.user, settings.default_level)
    urgency = settings.urgency_weight.get(job.urgency, 0.0)
    level_w = settings.level_weight.get(level, 0.0)
    aging = settings.aging_per_hour * max(0.0, now - queued_at) / 3600.0
    held = settings.held_per_gpu_hour * max(0.0, attained_gpu_s) / 3600.0
    return Score(total=urgency + level_w + aging - held, urgency=urgency, level=level_w,
                 aging=aging, held=held, user_level=level)


def queued_score(queued: Queued, now: float, settings: PolicySettings) -> Score:
    return score(queued.job, queued.queued_at, queued.attained_gpu_s, now, settings)


def attempt_gpu_s(running: Running, now: float) -> float:
    """GPU-seconds this attempt has held so far."""
    return max(0.0, now - running.started_at) * running.gpu_milli * len(
        running.gpu_ids) / 1000.0


def running_score(running: Running, now: float, settings: PolicySettings) -> Score:
    """A running task's score counts the GPU time of this attempt as held, too, and its
    aging stops when it starts: it waits no longer (so long holders do yield)."""
    waited_until = min(now, max(running.started_at, running.queued_at))
    return score(running.job, running.queued_at,
                 running.attained_gpu_s + attempt_gpu_s(running, now), waited_until,
                 settings)


def order(queue: Iterable[Queued], now: float,
          settings: PolicySettings) -> list[tuple[Queued, Score]]:
    """Immediate tier before background; within a tier highest score first, then the one
    waiting longest, then by id (deterministic)."""
    scored = [(q, queued_score(q, now, settings)) for q in queue]
    return sorted(scored, key=lambda qs: (qs[0].job.tier != "immediate", -qs[1].total,
                                          qs[0].queued_at, qs[0].job.task_id))
