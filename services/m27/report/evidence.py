"""What the history store knows of a run, gathered for its report: per step the metric
curves, the GPUs it held over its attempts with their readings, its checkpoints and its
training monitor's anomalies. Read once, when the report is written (blocking: SQLite).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from m27.common.curves import Curve
from m27.common.model import RunRecord
from m27.report.store import AnomalyMark, CheckpointMark, GpuPoint, History

CURVE_POINTS: Final = 400  # per curve drawn in a report (the summaries use every point)
GPU_POINTS: Final = 200  # per GPU and attempt
MAX_CURVES_PER_STEP: Final = 100
MAX_GPU_TRACES_PER_STEP: Final = 64


@dataclass(frozen=True)
class GpuTrace:
    """One GPU one attempt of a step held, with its readings over that span."""

    attempt: int
    node_id: str
    gpu: int
    share: float
    first_at: float
    last_at: float
    points: tuple[GpuPoint, ...]

    @property
    def label(self) -> str:
        return f"attempt {self.attempt} · {self.node_id} GPU {self.gpu}"


@dataclass(frozen=True)
class StepEvidence:
    curves: tuple[Curve, ...] = ()
    gpus: tuple[GpuTrace, ...] = ()
    checkpoints: tuple[CheckpointMark, ...] = ()
    anomalies: tuple[AnomalyMark, ...] = ()


@dataclass(frozen=True)
class RunEvidence:
    """By step name; a step the history knows nothing of is absent."""

    steps: dict[str, StepEvidence] = field(default_factory=dict)

    def of(self, step: str) -> StepEvidence:
        return self.steps.get(step, StepEvidence())


def gather(history: History, run: RunRecord) -> RunEvidence:
    """Everything the report draws for `run`, from `history`."""
    by_step: dict[str, list[Curve]] = {}
    for curve in history.curves(run.run_id, max_points=CURVE_POINTS, limit=10_000):
        by_step.setdefault(curve.step, []).append(curve)
    out: dict[str, StepEvidence] = {}
    for step in run.steps:
        task_id = f"{run.run_id}/{step.name}"
        curves = by_step.get(step.name, [])[:MAX_CURVES_PER_STEP]
        gpus = tuple(
            GpuTrace(attempt=h.attempt, node_id=h.node_id, gpu=h.gpu, share=h.share,
                     first_at=h.first_at, last_at=h.last_at,
                     points=tuple(history.gpu_trace(h.node_id, h.gpu, h.first_at, h.last_at,
                                                    GPU_POINTS)))
            for h in history.held_gpus(task_id)[:MAX_GPU_TRACES_PER_STEP])
        found = StepEvidence(curves=tuple(curves), gpus=gpus,
                             checkpoints=tuple(history.checkpoints(task_id)),
                             anomalies=tuple(history.anomalies(task_id)))
        if found.curves or found.gpus or found.checkpoints or found.anomalies:
            out[step.name] = found
    return RunEvidence(steps=out)
