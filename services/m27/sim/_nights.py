"""Which nights could have been met, and how many of their jobs were (pure).

A night job (the engine's `JobOutcome.night`: immediate tier, submitted 18:00–08:00) is
asked to finish by the next 09:00. Whether that was possible at all depends on the work
that night: a night *fits* when a lower bound on the immediate-tier GPU work that must run
between 18:00 and 09:00 is at most the cluster's GPU time in those 15 hours. The bound is
the larger of two, each a lower bound for any policy:

- *fluid carry-over*: the day's immediate work (submitted before 18:00) poured into the
  whole cluster as a fluid at full rate from time 0; what is still queued at 18:00 cannot
  have been done before it. This sees a day that overflowed.
- *per-job carry-over*: what each day job would still need after 18:00 had it started
  at its submission. This sees one long job the fluid would spread over every GPU.

plus the night's own submissions. Each job counts only up to 09:00 (its part that alone
falls before the morning). In a fitting night, a job counts unless its submission plus
its wall time alone is already past 09:00.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from m27.sim._metrics import JobOutcome
from m27.sim._workload import SimJob, Trace, expected_wall_s, gpu_count, gpus_of

NIGHT_S = 15 * 3600.0  # 18:00 to 09:00


class Nights(msgspec.Struct, frozen=True, kw_only=True):
    """Night jobs of the nights whose demand fits that alone could finish by 09:00, and
    how many did. Sums over runs with `+`."""

    nights: int
    nights_fit: int
    jobs: int
    done: int

    def __add__(self, other: Nights) -> Nights:
        return Nights(nights=self.nights + other.nights,
                      nights_fit=self.nights_fit + other.nights_fit,
                      jobs=self.jobs + other.jobs, done=self.done + other.done)


def _gpu_work(sims: Iterable[SimJob], morning: float) -> list[tuple[float, float, float]]:
    """(submit, GPUs, wall s up to the morning) of the immediate GPU jobs before it."""
    return sorted((s.submit_s, gpus_of(s), min(expected_wall_s(s), morning - s.submit_s))
                  for s in sims if s.job.tier == "immediate" and s.job.gpu_milli > 0
                  and s.submit_s < morning)


def night_demand(trace: Trace, morning: float) -> float:
    """A lower bound on the immediate GPU-s that must run 18:00–09:00 before `morning`."""
    evening, rate = morning - NIGHT_S, float(gpu_count(trace.nodes))
    queued = clock = per_job = night = 0.0
    for submit, gpus, wall in _gpu_work(trace.jobs, morning):
        if submit >= evening:
            night += gpus * wall
            continue
        queued = max(0.0, queued - rate * (submit - clock)) + gpus * wall
        clock = submit
        per_job += gpus * max(0.0, submit + wall - evening)
    fluid = max(0.0, queued - rate * (evening - clock))
    return max(fluid, per_job) + night


def night_check(trace: Trace, outcomes: Iterable[JobOutcome]) -> Nights:
    """The night jobs of the fitting nights, and how many finished by their 09:00."""
    sims = {s.job.task_id: s for s in trace.jobs}
    night = [o for o in outcomes if o.night and o.morning_s is not None]
    mornings = sorted({o.morning_s for o in night if o.morning_s is not None})
    room = gpu_count(trace.nodes) * NIGHT_S
    fit = {m for m in mornings if night_demand(trace, m) <= room}
    counted = [o for o in night if o.morning_s in fit
               and o.submit_s + expected_wall_s(sims[o.task_id]) <= (o.morning_s or 0.0)]
    done = [o for o in counted if o.end_s is not None and o.end_s <= (o.morning_s or 0.0)]
    return Nights(nights=len(mornings), nights_fit=len(fit), jobs=len(counted),
                  done=len(done))
