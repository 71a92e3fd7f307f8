"""The live dashboard's data (pure): what `/api/state` answers and the page draws — every
GPU's utilisation, memory and temperature over the last hours (downsampled by the history
store, so 1,000 GPUs are a few hundred thousand numbers, not millions), the queue with its
wait reasons, the running tasks with their shares, recent events and recent runs.

Times are unix seconds; a value a GPU did not report in a bucket is null, so a chart shows
a gap rather than a made-up line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec

from m27.client import RunSummary
from m27.client.scheduler import QueueItem
from m27.common import events
from m27.report.store import GpuPoint

MAX_EVENTS: Final = 200
MAX_HOURS: Final = 72.0
POINTS_PER_GPU: Final = 120  # per GPU and span: what a chart a few hundred pixels wide shows
MAX_POINTS_PER_GPU: Final = 1000


class GpuSeries(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    gpu: int
    t: list[float]
    util: list[float | None]
    mem: list[int | None]
    temp: list[float | None]


class Task(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    run_id: str
    step: str
    user: str
    state: str  # waiting, running, paused, stopping
    gpus: float
    node: str
    reason: str  # why it waits, or why it stops
    lender: str = ""  # a backfill's lender
    since: float = 0.0  # queued at


class Run(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    name: str
    user: str
    state: str
    created_at: float
    ended_at: float | None
    steps: str  # "3/5 succeeded, 1 failed"
    report: str  # the dashboard's link to its report ("" until written)
    compare: str  # the dashboard's link to its comparison


class Event(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    kind: str
    subject: str
    text: str


class State(msgspec.Struct, frozen=True, kw_only=True):
    now: float
    hours: float
    simulated: bool  # readings of simulated GPUs are modelled, not measured
    gpus: list[GpuSeries]
    waiting: list[Task]
    running: list[Task]
    runs: list[Run]
    events: list[Event]
    problems: list[str]  # what could not be read (a service down): shown, never fatal


def gpu_series(history: Mapping[tuple[str, int], Sequence[GpuPoint]]) -> list[GpuSeries]:
    """Each GPU's buckets as columns, ordered by node and index."""
    out = []
    for (node, gpu), points in sorted(history.items()):
        out.append(GpuSeries(
            node=node, gpu=gpu, t=[p.at for p in points],
            util=[round(p.utilization_pct, 1) for p in points],
            mem=[p.memory_used_mb for p in points],
            temp=[round(p.temperature_c, 1) for p in points]))
    return out


def tasks(items: Iterable[QueueItem]) -> tuple[list[Task], list[Task]]:
    """The queue as (waiting in policy order, placed ones)."""
    waiting: list[Task] = []
    placed: list[Task] = []
    for item in items:
        task = Task(task_id=item.task_id, run_id=item.run_id, step=item.step,
                    user=item.user, state=item.state, gpus=item.gpus, node=item.node_id,
                    reason=item.reason, lender=item.lender, since=item.queued_at)
        (waiting if item.state == "waiting" else placed).append(task)
    return waiting, placed


def runs(summaries: Iterable[RunSummary], *, reported: set[str]) -> list[Run]:
    """Recent runs with the dashboard's links (a report once it is written)."""
    out = []
    for r in summaries:
        parts = [f"{r.steps_succeeded}/{r.steps_total} succeeded"]
        if r.steps_failed:
            parts.append(f"{r.steps_failed} failed")
        out.append(Run(run_id=r.run_id, name=r.name, user=r.user, state=r.state,
                       created_at=r.created_at, ended_at=r.ended_at, steps=", ".join(parts),
                       report=f"reports/{r.run_id}.html" if r.run_id in reported else "",
                       compare=f"compare/{r.run_id}"))
    return out


def event_line(subject: str, event: events.Event) -> Event:
    """One bus event as a line of the dashboard's event list."""
    kind = events.tag_of(event)
    data: dict[str, Any] = msgspec.to_builtins(event)
    who = data.get("task_id") or data.get("run_id") or data.get("node_id") or ""
    detail = [f"{k}={data[k]}" for k in ("state", "kind", "metric", "cause", "exit_code",
                                         "reason") if data.get(k) not in (None, "", ())]
    text = " ".join([str(who), *detail])[:300]
    return Event(at=float(data.get("at", 0.0)), kind=kind, subject=subject, text=text)


def hours_asked(text: str | None) -> float:
    """`?hours=` as used: 1 when absent or not a positive number, at most 72."""
    try:
        value = float(text) if text else 1.0
    except ValueError:
        return 1.0
    if not value > 0 or value == float("inf"):
        return 1.0
    return min(value, MAX_HOURS)


def points_asked(text: str | None) -> int:
    """`?points=` as used: `POINTS_PER_GPU` when absent or not a number, kept in 10..1000."""
    try:
        value = int(text) if text else POINTS_PER_GPU
    except ValueError:
        return POINTS_PER_GPU
    return min(max(value, 10), MAX_POINTS_PER_GPU)
