"""The metrics-file format and how a step's attempts make one series."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.events import MetricPoint
from m27.common.metric_points import MAX_LINE_BYTES, parse_line, series


@pytest.mark.parametrize(("line", "values", "at"), [
    (b'{"step": 120, "loss": 0.41, "acc": 0.83}', {"loss": 0.41, "acc": 0.83}, 7.0),
    (b'{"step": 0, "t": 1764578123.5, "loss": 1}', {"loss": 1.0}, 1764578123.5),
    (b'{"step": 3, "loss": NaN, "g": Infinity, "h": -Infinity}',
     {"loss": "NaN", "g": "Infinity", "h": "-Infinity"}, 7.0),
    (b'{"step": 3, "loss": null, "train/loss.ema-1": 2}',
     {"loss": "NaN", "train/loss.ema-1": 2.0}, 7.0),
])
def test_lines_that_are_points(line: bytes, values: dict[str, object], at: float) -> None:
    point = parse_line(line, 7.0)
    assert isinstance(point, MetricPoint)
    assert (point.values, point.at) == (values, at)


@pytest.mark.parametrize(("line", "problem"), [
    (b"loss=0.4", "not JSON"), (b"[1, 2]", "not a JSON object"), (b"\xff\xfe", "not JSON"),
    (b'{"loss": 1}', "no integer `step`"), (b'{"step": -1, "loss": 1}', "no integer `step`"),
    (b'{"step": 1.5, "loss": 1}', "no integer `step`"),
    (b'{"step": true, "loss": 1}', "no integer `step`"), (b'{"step": 1}', "no metric"),
    (b'{"step": 1, "loss": "low"}', "str is not a number"),
    (b'{"step": 1, "ok": true}', "bool is not a number"),
    (b'{"step": 1, "bad name": 1}', "metric name 'bad name'"),
    (b'{"step": 1, "t": "noon", "loss": 1}', "`t` is not a time"),
    (b'{"step": 1, "t": NaN, "loss": 1}', "`t` is not a time"),
    (b"[" * 100_000, "a line longer than"),
    (b"[" * 50_000, "not JSON"),  # nesting deeper than the parser's recursion
    (b'{"step": 1, ' + b", ".join(b'"m%d": 1' % i for i in range(201)) + b"}",
     "more than 200 metrics"),
])
def test_lines_that_are_not_points_say_why(line: bytes, problem: str) -> None:
    assert len(line) <= MAX_LINE_BYTES or problem.startswith("a line longer")
    got = parse_line(line, 0.0)
    assert isinstance(got, str)
    assert problem in got


def point(step: int, attempt: int) -> MetricPoint:
    return MetricPoint(step=step, at=float(step), values={"loss": float(attempt)})


def test_a_resumed_attempt_replaces_what_it_redid() -> None:
    first = [point(s, 1) for s in range(150)]  # ran to 149, checkpointed at 100
    second = [point(s, 2) for s in range(100, 200, 10)]  # resumed at 100, logs every 10
    merged = series({2: second, 1: first})
    assert [p.step for p in merged] == [*range(100), *range(100, 200, 10)]
    assert {p.values["loss"] for p in merged if p.step >= 100} == {2.0}
    assert series({}) == []
    again = MetricPoint(step=5, at=6.0, values={"loss": 0.5})  # the same step logged twice
    assert series({1: [point(5, 1), again]}) == [again]


attempt_points = st.lists(st.integers(0, 50), max_size=30).map(sorted)


@given(st.dictionaries(st.integers(1, 5), attempt_points, max_size=5))
def test_the_series_is_each_steps_point_from_the_last_attempt_that_redid_it(
        logged: dict[int, list[int]]) -> None:
    attempts = {a: [point(s, a) for s in steps] for a, steps in logged.items()}
    merged = series(attempts)
    steps = [p.step for p in merged]
    assert steps == sorted(set(steps))
    for p in merged:
        owner = int(p.values["loss"])
        later = [a for a, ps in attempts.items() if a > owner and ps]
        assert all(p.step < min(q.step for q in attempts[a]) for a in later)
    expected = {s for a, ps in attempts.items() for s in (q.step for q in ps)
                if all(s < min(q.step for q in attempts[b]) for b in attempts
                       if b > a and attempts[b])}
    assert set(steps) == expected
    assert all(math.isfinite(p.at) for p in merged)
