"""The report's embedded history: idempotent writes, the attempt rule in SQL agreeing with
the pure one, GPU history from rollups agreeing with the raw samples, retention."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.events import GpuTelemetry, MetricPoint, MetricPoints
from m27.common.metric_points import series
from m27.common.model import GpuSample, TaskHolding
from m27.report.store import HeldGpu, History

RUN = "r-20261204-033000-abcdef"


def batch(attempt: int, steps: list[int], offset: int = 0) -> MetricPoints:
    return MetricPoints(
        at=0.0, task_id=f"{RUN}/train", run_id=RUN, step="train", attempt=attempt,
        node_id="n1", offset=offset,
        points=tuple(MetricPoint(step=s, at=float(s), values={"loss": float(attempt * 1000 + s)})
                     for s in steps))


@pytest.fixture
def history(tmp_path: Path) -> History:
    return History(tmp_path / "history.sqlite")


def test_a_message_stored_twice_is_stored_once(history: History) -> None:
    history.add_metrics(batch(1, [0, 1, 2]))
    history.add_metrics(batch(1, [0, 1, 2]))
    assert [p.step for p in history.metric_series(RUN, "train", "loss")] == [0, 1, 2]
    sample = GpuSample(index=0, utilization_pct=50.0, memory_used_mb=10, temperature_c=40.0)
    history.add_gpu_samples("n1", 100.0, [sample])
    history.add_gpu_samples("n1", 100.0, [sample])
    (points,) = history.gpu_history(0.0, 3600.0, max_points=10).values()
    assert len(points) == 1
    assert points[0].utilization_pct == 50.0


def test_non_finite_values_survive(history: History) -> None:
    history.add_metrics(MetricPoints(
        at=0.0, task_id=f"{RUN}/train", run_id=RUN, step="train", attempt=1, node_id="n1",
        offset=0, points=(MetricPoint(step=0, at=0.0, values={"loss": "NaN", "g": "Infinity"}),)))
    assert history.metric_series(RUN, "train", "loss")[0].values == {"loss": "NaN"}
    assert history.metric_series(RUN, "train", "g")[0].values == {"g": math.inf}
    assert history.metric_names(RUN, "train") == ["g", "loss"]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(1, 4),
                       st.lists(st.integers(0, 40), max_size=15, unique=True).map(sorted),
                       max_size=4))
def test_the_sql_series_is_the_pure_series(logged: dict[int, list[int]]) -> None:
    history = History(":memory:")
    for attempt, steps in logged.items():
        history.add_metrics(batch(attempt, steps))
    expected = series({a: batch(a, s).points for a, s in logged.items()})
    got = history.metric_series(RUN, "train", "loss")
    assert [(p.step, p.values["loss"]) for p in got] == [
        (p.step, p.values["loss"]) for p in expected]


def test_gpu_history_from_rollups_matches_the_raw_samples(history: History) -> None:
    start = 600.0 * 1667  # on the 10-minute grid
    for k in range(720 * 2):  # 2 h of 5 s samples, 2 GPUs
        at = start + 5 * k
        history.add_gpu_samples("n1", at, [
            GpuSample(index=g, utilization_pct=float(k % 100), memory_used_mb=k,
                      temperature_c=30.0 + g, power_w=100.0) for g in (0, 1)])
    since, until = start, start + 7200
    coarse = history.gpu_history(since, until, max_points=12)  # 10-min buckets
    fine = history.gpu_history(since, until, max_points=2000)  # the raw samples
    assert set(coarse) == {("n1", 0), ("n1", 1)}
    assert [len(v) for v in coarse.values()] == [12, 12]
    raw = fine[("n1", 0)]
    for i, bucket in enumerate(coarse[("n1", 0)]):
        inside = [p for p in raw if since + i * 600 <= p.at < since + (i + 1) * 600]
        assert bucket.utilization_pct == pytest.approx(
            sum(p.utilization_pct for p in inside) / len(inside))
        assert bucket.memory_used_mb == max(p.memory_used_mb for p in inside)
        assert bucket.power_w == pytest.approx(100.0)
    baseline = history.gpu_history_from_raw(since, until, max_points=12)
    assert {k: [(p.at, round(p.utilization_pct, 9), p.memory_used_mb) for p in v]
            for k, v in baseline.items()} == {
        k: [(p.at, round(p.utilization_pct, 9), p.memory_used_mb) for p in v]
        for k, v in coarse.items()}


def test_prune_forgets_the_old(history: History) -> None:
    sample = GpuSample(index=0, utilization_pct=1.0, memory_used_mb=1, temperature_c=1.0)
    for at in (10.0, 5000.0):
        history.add_gpu_samples("n1", at, [sample])
    history.add_metrics(batch(1, [1, 4000]))
    history.prune(before=3600.0)
    assert [p.at for p in history.gpu_history(0.0, 10_000.0, 10_000)[("n1", 0)]] == [5000.0]
    assert [p.step for p in history.metric_series(RUN, "train", "loss")] == [4000]


def reading(at: float, seq: int, *tasks: TaskHolding, node: str = "n1") -> GpuTelemetry:
    return GpuTelemetry(at=at, node_id=node, incarnation="i1", seq=seq,
                        backend="simulated", gpus=tuple(
                            GpuSample(index=g, utilization_pct=50.0, memory_used_mb=g,
                                      temperature_c=40.0, simulated=True) for g in (0, 1)),
                        tasks=tasks)


def test_telemetry_keeps_the_samples_and_who_held_each_gpu(history: History) -> None:
    whole = TaskHolding(task_id="r1/train", attempt=1, gpu_ids=(0, 1), gpu_share=2.0)
    half = TaskHolding(task_id="r2/prep", attempt=3, gpu_ids=(1,), gpu_share=0.5)
    readings = [reading(100.0, 1, whole), reading(105.0, 2, whole, half),
                reading(110.0, 3, half)]
    history.add_telemetry(readings)
    history.add_telemetry(readings[1:])  # redelivered: changes nothing
    assert history.held_gpus("r1/train") == [
        HeldGpu("r1/train", 1, "n1", 0, 1.0, 100.0, 105.0),
        HeldGpu("r1/train", 1, "n1", 1, 1.0, 100.0, 105.0)]
    assert history.held_gpus("r2/prep") == [HeldGpu("r2/prep", 3, "n1", 1, 0.5, 105.0, 110.0)]
    assert [h.task_id for h in history.holders("n1", 1, 105.0)] == ["r1/train", "r2/prep"]
    assert [h.task_id for h in history.holders("n1", 1, 108.0)] == ["r2/prep"]
    assert history.holders("n1", 0, 108.0) == []
    assert history.holders("n2", 1, 105.0) == []
    samples = history.gpu_history(0.0, 200.0, max_points=1000)
    assert [p.at for p in samples[("n1", 0)]] == [100.0, 105.0, 110.0]
    coarse = history.gpu_history(0.0, 200.0, max_points=1)  # a rollup counts each once
    assert coarse == history.gpu_history_from_raw(0.0, 200.0, max_points=1)


def test_a_later_attempt_is_its_own_span_and_old_spans_are_pruned(history: History) -> None:
    first = TaskHolding(task_id="r1/train", attempt=1, gpu_ids=(0,), gpu_share=1.0)
    again = TaskHolding(task_id="r1/train", attempt=2, gpu_ids=(1,), gpu_share=1.0)
    history.add_telemetry([reading(10.0, 1, first), reading(20.0, 2, first)])
    history.add_telemetry([reading(5000.0, 9, again, node="n2")])
    assert [(h.attempt, h.node_id, h.gpu) for h in history.held_gpus("r1/train")] == [
        (1, "n1", 0), (2, "n2", 1)]
    history.prune(before=3600.0)
    assert [(h.attempt, h.first_at) for h in history.held_gpus("r1/train")] == [(2, 5000.0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["a/x", "b/y"]),
                          st.integers(1, 3), st.integers(0, 3)), max_size=40))
def test_a_span_is_the_first_and_last_reading_that_showed_it(
        seen: list[tuple[int, str, int, int]]) -> None:
    history = History(":memory:")
    history.add_telemetry([reading(float(at), at, TaskHolding(
        task_id=task, attempt=attempt, gpu_ids=(gpu,), gpu_share=1.0))
        for at, task, attempt, gpu in seen])
    for task in ("a/x", "b/y"):
        expected: dict[tuple[int, int], list[float]] = {}
        for at, t, attempt, gpu in seen:
            if t == task:
                expected.setdefault((attempt, gpu), []).append(float(at))
        assert {(h.attempt, h.gpu): (h.first_at, h.last_at)
                for h in history.held_gpus(task)} == {
            k: (min(v), max(v)) for k, v in expected.items()}


def test_curves_are_the_series_summarised_filtered_and_capped(history: History) -> None:
    history.add_metrics(batch(1, list(range(50))))
    history.add_metrics(batch(2, list(range(40, 60)), offset=1))  # resumed at step 40
    other = MetricPoints(at=0.0, task_id=f"{RUN}/eval", run_id=RUN, step="eval", attempt=1,
                         node_id="n1", offset=0,
                         points=(MetricPoint(step=0, at=0.0, values={"acc": 0.5, "loss": 1.0}),))
    history.add_metrics(other)
    [train] = history.curves(RUN, steps={"train"}, max_points=10)
    assert (train.step, train.name, train.count, train.last, train.last_step) == (
        "train", "loss", 60, 2059.0, 59)
    assert train.min == (1000.0, 0)  # over every point, not the ten drawn
    assert len(train.steps) <= 10
    assert [(c.step, c.name) for c in history.curves(RUN)] == [
        ("eval", "acc"), ("eval", "loss"), ("train", "loss")]
    assert [c.name for c in history.curves(RUN, names={"acc"})] == ["acc"]
    assert len(history.curves(RUN, limit=2)) == 2
    assert history.curves("r-20000101-000000-000000") == []
