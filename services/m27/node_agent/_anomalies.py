"""A running attempt's training monitor: the step's metrics, as the agent reads them from
its metrics file, through the detector (`m27.common.training_monitor`), one state per
metric the step's `monitor:` names.

Each chunk of points is watched once, however often it is read (a publish that failed is
read again), and what it found waits here as `training_anomaly` events until they are
published (`outbox`); what the agent does about each (checkpoint, stop) is the runner's.

A step's own curve cannot flood the agent: at most EVENTS_PER_MINUTE anomalies of an
attempt become events (the rest are counted in `suppressed`), and a checkpoint is asked
for (and the one before protected) at most once per ACT_EVERY_S.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from m27.common.events import MetricPoint, StartTask, TrainingAnomaly
from m27.common.training_monitor import MonitorState, observe, value_of

#: Anomalies not yet published that an attempt keeps (the oldest go first).
OUTBOX_MAX: Final = 1000
EVENTS_PER_MINUTE: Final = 30
ACT_EVERY_S: Final = 30.0


@dataclass
class TrainingWatch:
    cmd: StartTask
    node_id: str
    states: list[MonitorState] = field(default_factory=list)
    watched_to: tuple[int, int] = (0, -1)  # (truncations, offset) of the last chunk watched
    outbox: deque[TrainingAnomaly] = field(default_factory=lambda: deque(maxlen=OUTBOX_MAX))
    suppressed: int = 0  # anomalies past EVENTS_PER_MINUTE, not published
    _recent: deque[float] = field(default_factory=deque)  # when the last events were found
    _acted_at: float | None = None

    def __post_init__(self) -> None:
        self.states = [MonitorState() for _ in self.cmd.monitor]

    def feed(self, offset: int, points: Sequence[MetricPoint], now: float,
             truncations: int = 0) -> list[TrainingAnomaly]:
        """The anomalies the chunk of points read at `offset` (after the file was truncated
        `truncations` times) starts — none for a chunk watched before; they are also
        queued in `outbox`."""
        if (truncations, offset) <= self.watched_to:
            return []
        self.watched_to = (truncations, offset)
        found: list[TrainingAnomaly] = []
        for point in points:
            for index, spec in enumerate(self.cmd.monitor):
                raw = point.values.get(spec.metric)
                if raw is None:
                    continue
                self.states[index], started = observe(self.states[index], spec, point.step,
                                                      value_of(raw))
                found += [TrainingAnomaly(
                    at=now, task_id=self.cmd.task_id, run_id=self.cmd.run_id,
                    step=self.cmd.step, attempt=self.cmd.attempt, node_id=self.node_id,
                    kind=a.kind, metric=a.metric, train_step=a.step,
                    value=a.value if math.isfinite(a.value) else str(raw),
                    baseline=a.baseline, detail=a.detail, actions=spec.on_anomaly)
                    for a in started]
        kept = [event for event in found if self._admit(now)]
        self.suppressed += len(found) - len(kept)
        self.outbox.extend(kept)
        return kept

    def _admit(self, now: float) -> bool:
        while self._recent and self._recent[0] <= now - 60.0:
            self._recent.popleft()
        if len(self._recent) >= EVENTS_PER_MINUTE:
            return False
        self._recent.append(now)
        return True

    def may_act(self, now: float) -> bool:
        """Whether the agent may ask for a checkpoint now (at most one per ACT_EVERY_S)."""
        if self._acted_at is not None and now - self._acted_at < ACT_EVERY_S:
            return False
        self._acted_at = now
        return True


def anomaly_msg_id(event: TrainingAnomaly) -> str:
    return (f"{event.task_id}:{event.attempt}:anomaly:{event.metric}:{event.kind}:"
            f"{event.train_step}")
