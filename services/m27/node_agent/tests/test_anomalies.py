"""The agent's side of the training monitor: each chunk watched once, and a step's own
curve cannot flood it with events or checkpoint requests."""

from __future__ import annotations

import math

from m27.common.events import MetricPoint, StartTask
from m27.common.model import MonitorSpec
from m27.node_agent._anomalies import ACT_EVERY_S, EVENTS_PER_MINUTE, TrainingWatch


def watch(**spec: object) -> TrainingWatch:
    cmd = StartTask(at=0.0, task_id="r-1/train", run_id="r-1", step="train", attempt=1,
                    step_type="gpu", command="x", monitor=(MonitorSpec(**spec),))  # type: ignore[arg-type]
    return TrainingWatch(cmd, "gpu-1")


def points(values: list[float | str], first: int = 0) -> list[MetricPoint]:
    return [MetricPoint(step=first + i, at=float(i), values={"loss": v, "other": 1.0})
            for i, v in enumerate(values)]


def test_a_chunk_read_again_is_not_watched_again() -> None:
    training = watch()
    chunk = points([1.0, "NaN"])
    assert [a.kind for a in training.feed(0, chunk, now=1.0)] == ["nan"]
    assert training.feed(0, chunk, now=2.0) == []  # the publish failed: read again
    assert [a.value for a in training.outbox] == ["NaN"]
    assert training.outbox[0].actions == ("checkpoint", "notify")
    # the program truncated its file and writes from the start again: watched again
    again = points([*[1.0] * 10, "NaN"], first=10)  # calm for `warmup`, then NaN again
    assert [a.kind for a in training.feed(0, again, now=3.0, truncations=1)] == ["nan"]


def test_an_alternating_curve_cannot_flood_the_agent() -> None:
    """NaN after every warmup of calm values starts an episode each time: at most
    EVENTS_PER_MINUTE of them a minute become events, the rest are counted."""
    training = watch(warmup=1)
    found = training.feed(0, points([v for _ in range(200) for v in (1.0, math.nan)]),
                          now=10.0)
    assert len(found) == EVENTS_PER_MINUTE
    assert training.suppressed == 200 - EVENTS_PER_MINUTE
    later = training.feed(10_000, points([1.0, math.nan], first=400), now=71.0)
    assert len(later) == 1  # a minute on, events flow again


def test_checkpoints_are_asked_for_at_most_once_per_interval() -> None:
    training = watch()
    assert training.may_act(100.0)
    assert not training.may_act(100.0 + ACT_EVERY_S - 1)
    assert training.may_act(100.0 + ACT_EVERY_S)
