"""What a simulation measured, and the summary a user reads (pure).

- allocation: GPU time held by some task (a share counts its share) / GPU time available.
- utilization: GPU time busy (a share counts its share while not in I/O or paused; capped
  at one GPU per GPU) / GPU time available.
- goodput: work kept, counted at solo speed (a share's speed on its own slice), minus work
  lost to preemptions and failures, / GPU time available. Sharing that slows jobs down
  lowers goodput, not utilization, so goodput ≤ utilization ≤ 1.
"""

from __future__ import annotations

import math

import msgspec


class JobOutcome(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    kind: str
    tier: str
    submit_s: float
    first_start_s: float | None
    end_s: float | None  # None: not finished within the simulated span
    attempts: int
    night: bool  # submitted 18:00–08:00 with its 09:00 inside the simulated span
    morning_s: float | None
    preemptions: int = 0  # times this task was preempted (all attempts)


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """Means over one bucket of virtual time, in GPUs."""

    start_s: float
    busy_gpus: float
    alloc_gpus: float
    work_gpus: float


class RawRun(msgspec.Struct, frozen=True, kw_only=True):
    gpus: int
    span_s: float
    busy_gpu_s: float
    alloc_gpu_s: float
    work_gpu_s: float
    lost_gpu_s: float
    preemptions: int
    failures: int
    policy_calls: int
    max_gpu_compute_milli: float  # the most compute any GPU delivered at once
    rejected: dict[str, int]  # decisions the engine refused, by why
    outcomes: tuple[JobOutcome, ...]
    samples: tuple[Sample, ...]
    not_arrived: int = 0
    maintenance_kills: int = 0  # tasks killed by a cron reset (SimConfig.maintenance)
    #: GPU time held by tasks' own shares (not backfills) while they stage their inputs /
    #: wait on I/O: idle unless a backfill or a co-located task uses it.
    held_staging_gpu_s: float = 0.0
    held_io_gpu_s: float = 0.0
    #: Of those, the part before the idle was detected (`SimConfig.idle_detect_s`): no
    #: policy can lend it, so busy time ≤ 1 − held_unseen / GPU time.
    held_unseen_gpu_s: float = 0.0


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    trace: str
    gpus: int
    hours: float
    allocation: float
    utilization: float
    goodput: float
    jobs: int
    completed: int
    mean_jct_s: float | None
    p95_jct_s: float | None
    mean_queue_s: float | None
    p95_queue_s: float | None
    night_jobs: int
    night_done_by_9: int
    night_share: float | None
    preemptions: int
    failures: int
    lost_gpu_h: float
    rejected_decisions: int
    #: Preemptions by kind of task (`SimJob.kind`, "" unnamed), and the tasks preempted
    #: most, most first (at most `MOST_PREEMPTED`): where thrash would show.
    preemptions_by_kind: dict[str, int] = msgspec.field(default_factory=dict)
    most_preempted: tuple[tuple[str, int], ...] = ()
    maintenance_kills: int = 0  # tasks a cron reset killed (SimConfig.maintenance)


MOST_PREEMPTED = 5


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): a value that occurred."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(raw: RawRun, *, policy: str, trace: str) -> Metrics:
    capacity = raw.gpus * raw.span_s
    done = [o for o in raw.outcomes if o.end_s is not None]
    jcts = [o.end_s - o.submit_s for o in done if o.end_s is not None]
    waits = [o.first_start_s - o.submit_s for o in raw.outcomes if o.first_start_s is not None]
    night = [o for o in raw.outcomes if o.night]
    by_nine = [o for o in night if o.end_s is not None and o.morning_s is not None
               and o.end_s <= o.morning_s]
    return Metrics(
        policy=policy, trace=trace, gpus=raw.gpus, hours=raw.span_s / 3600.0,
        allocation=raw.alloc_gpu_s / capacity if capacity else 0.0,
        utilization=raw.busy_gpu_s / capacity if capacity else 0.0,
        goodput=max(0.0, raw.work_gpu_s - raw.lost_gpu_s) / capacity if capacity else 0.0,
        jobs=len(raw.outcomes), completed=len(done), mean_jct_s=mean(jcts),
        p95_jct_s=percentile(jcts, 95), mean_queue_s=mean(waits),
        p95_queue_s=percentile(waits, 95), night_jobs=len(night),
        night_done_by_9=len(by_nine),
        night_share=len(by_nine) / len(night) if night else None,
        preemptions=raw.preemptions, failures=raw.failures,
        lost_gpu_h=raw.lost_gpu_s / 3600.0, rejected_decisions=sum(raw.rejected.values()),
        preemptions_by_kind=_by_kind(raw.outcomes),
        most_preempted=tuple((o.task_id, o.preemptions) for o in sorted(
            (o for o in raw.outcomes if o.preemptions),
            key=lambda o: (-o.preemptions, o.task_id))[:MOST_PREEMPTED]),
        maintenance_kills=raw.maintenance_kills)


def _by_kind(outcomes: tuple[JobOutcome, ...]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for o in outcomes:
        if o.preemptions:
            kinds[o.kind] = kinds.get(o.kind, 0) + o.preemptions
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def format_preemptions(rows: list[Metrics]) -> str:
    """Per policy that preempted: preemptions by kind of task and the most preempted tasks,
    e.g. `m27: 4 preemptions (prep 4); most preempted: prep-2 ×1, prep-3 ×1`."""
    lines = []
    for m in rows:
        if not m.preemptions:
            continue
        kinds = ", ".join(f"{k or 'other'} {n}" for k, n in m.preemptions_by_kind.items())
        most = ", ".join(f"{t} ×{n}" for t, n in m.most_preempted)
        lines.append(f"{m.policy}: {m.preemptions} preemptions ({kinds}); most preempted: "
                     f"{most}")
    return "\n".join(lines)


def jct_values(raw: RawRun) -> list[float]:
    return sorted(o.end_s - o.submit_s for o in raw.outcomes if o.end_s is not None)


def format_table(rows: list[Metrics]) -> str:
    """One line per run, aligned; times in hours."""
    head = ("policy", "GPUs", "hours", "alloc%", "util%", "goodput%", "done/jobs",
            "meanJCT h", "p95JCT h", "meanQ h", "night≤9", "preempt")
    lines = [head]
    for m in rows:
        night = (f"{m.night_done_by_9}/{m.night_jobs}" if m.night_jobs else "—")
        lines.append((m.policy, str(m.gpus), f"{m.hours:.1f}", f"{100 * m.allocation:.1f}",
                      f"{100 * m.utilization:.1f}", f"{100 * m.goodput:.1f}",
                      f"{m.completed}/{m.jobs}", _hours(m.mean_jct_s), _hours(m.p95_jct_s),
                      _hours(m.mean_queue_s), night, str(m.preemptions)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def _hours(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds / 3600.0:.2f}"
