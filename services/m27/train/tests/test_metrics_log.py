"""`m27.train.log`: every point from every thread reaches the file, in the format the
node-agent reads; nothing outside m27 unless asked; bad arguments say what is wrong; a
stalled writer never blocks the caller."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

import m27.train
from m27.common.events import MetricPoint
from m27.common.metric_points import parse_line
from m27.train import _metrics


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_metrics, "_writer", None)
    monkeypatch.setattr(_metrics, "_configured", False)
    monkeypatch.delenv(_metrics.ENV, raising=False)


def points(path: Path) -> list[MetricPoint]:
    parsed = [parse_line(line, 0.0) for line in path.read_bytes().splitlines()]
    assert all(isinstance(p, MetricPoint) for p in parsed), parsed
    return [p for p in parsed if isinstance(p, MetricPoint)]


def test_points_from_many_threads_all_arrive_in_the_metrics_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.jsonl"
    monkeypatch.setenv(_metrics.ENV, str(path))

    def worker(offset: int) -> None:
        for i in range(2000):
            m27.train.log(offset + i, loss=1.0 / (i + 1), gpu=offset)

    threads = [threading.Thread(target=worker, args=(k * 10_000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert m27.train.flush_metrics()
    got = points(path)
    assert len(got) == 8000
    assert sorted(p.step for p in got) == sorted(k * 10_000 + i for k in range(4)
                                                 for i in range(2000))
    m27.train.log(5, loss=math.nan, grad=math.inf, ok=3)
    assert m27.train.flush_metrics()
    assert points(path)[-1].values == {"loss": "NaN", "grad": "Infinity", "ok": 3.0}


def test_outside_m27_nothing_is_written_unless_a_file_is_named(tmp_path: Path) -> None:
    m27.train.log(1, loss=0.5)  # no $M27_METRICS_FILE: a no-op
    assert m27.train.flush_metrics()
    path = tmp_path / "local.jsonl"
    m27.train.log_to(path)
    m27.train.log(2, loss=0.25)
    assert m27.train.flush_metrics()
    assert [(p.step, p.values) for p in points(path)] == [(2, {"loss": 0.25})]


@pytest.mark.parametrize(("step", "scalars", "problem"), [
    (-1, {"loss": 1.0}, "step must be an integer"), (1.5, {"loss": 1.0}, "step must be"),
    (True, {"loss": 1.0}, "step must be"), (1, {}, "at least one metric"),
    (1, {"loss": "low"}, "str is not a number"), (1, {"ok": True}, "bool is not a number"),
    (1, {"t": 1.0}, "not 'step' or 't'"),
])
def test_bad_arguments_say_what_is_wrong(step: object, scalars: dict[str, object],
                                         problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        m27.train.log(step, **scalars)  # type: ignore[arg-type]


def test_a_writer_that_cannot_write_drops_points_and_never_blocks(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = _metrics.MetricWriter(blocked / "under-a-file.jsonl", max_pending=3)
    for i in range(10):
        writer.add(json.dumps({"step": i, "loss": 1}) + "\n")
    assert writer.dropped == 7
    assert writer.flush(timeout=1.0) is False


def test_work_totals_are_metrics_named_work_dot_unit(tmp_path: Path) -> None:
    path = tmp_path / "work.jsonl"
    m27.train.log_to(path)
    m27.train.log_work(10, flops=3.1e15, samples=1280)
    assert m27.train.flush_metrics()
    assert [(p.step, p.values) for p in points(path)] == [
        (10, {"work.flops": 3.1e15, "work.samples": 1280.0})]
    for bad in ({"flops": -1.0}, {"flops": math.nan}, {"flops": math.inf}, {"flops": True},
                {"flops": "many"}, {}):
        with pytest.raises(ValueError, match="log_work"):
            m27.train.log_work(11, **bad)
