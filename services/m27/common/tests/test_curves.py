"""A curve's summary and its thinned copy (`m27.common.curves`): the summary is over every
point; thinning keeps the first and last points, the extremes and a non-finite value, and
never more than asked."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.curves import (
    DEFAULT_POINTS,
    MAX_POINTS,
    MIN_POINTS,
    points_asked,
    summarize,
    thin,
)

values = st.lists(st.one_of(st.floats(-1e6, 1e6), st.just(math.nan), st.just(math.inf),
                            st.just(-math.inf)), min_size=0, max_size=3000)


def test_points_asked_defaults_and_bounds() -> None:
    assert [points_asked(n) for n in (0, -5, 1, 2, 500, 10**9)] == [
        DEFAULT_POINTS, DEFAULT_POINTS, MIN_POINTS, MIN_POINTS, 500, MAX_POINTS]
    assert thin([1.0, 2.0, 3.0], 2) == [0, 2]


def test_a_short_curve_is_kept_whole_and_summarised() -> None:
    curve = summarize("train", "loss", [0, 1, 2, 3], [2.0, math.nan, 0.5, 0.7], 99.0)
    assert (curve.steps, curve.count, curve.last, curve.last_step) == ((0, 1, 2, 3), 4, 0.7, 3)
    assert (curve.min, curve.max, curve.best("min"), curve.best("max")) == (
        (0.5, 2), (2.0, 0), (0.5, 2), (2.0, 0))
    assert math.isnan(curve.values[1])
    nothing = summarize("train", "loss", [0, 1], [math.nan, math.inf])
    assert (nothing.min, nothing.max, nothing.last) == (None, None, math.inf)
    empty = summarize("train", "loss", [], [])
    assert (empty.count, empty.steps, math.isnan(empty.last)) == (0, (), True)


def test_a_spike_and_a_nan_survive_thinning() -> None:
    ys = [1.0 / (i + 1) for i in range(100_000)]
    ys[31_337] = 50.0
    ys[77_777] = math.nan
    kept = thin(ys, 200)
    assert len(kept) <= 200
    assert {0, 31_337, 77_777, 99_999} <= set(kept)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(MIN_POINTS, 400))
def test_thinning_keeps_ends_extremes_and_an_odd_value(ys: list[float], most: int) -> None:
    kept = thin(ys, most)
    assert len(kept) <= most
    assert kept == sorted(set(kept))
    if not ys:
        assert kept == []
        return
    assert kept[0] == 0
    assert kept[-1] == len(ys) - 1
    if len(ys) <= most:
        assert kept == list(range(len(ys)))
        return
    finite = [i for i, y in enumerate(ys) if math.isfinite(y)]
    if finite:
        assert min(ys[i] for i in kept if math.isfinite(ys[i])) == min(ys[i] for i in finite)
        assert max(ys[i] for i in kept if math.isfinite(ys[i])) == max(ys[i] for i in finite)
    if any(not math.isfinite(y) for y in ys):
        assert any(not math.isfinite(ys[i]) for i in kept)


@settings(max_examples=200, deadline=None)
@given(values)
def test_the_summary_is_over_every_point(ys: list[float]) -> None:
    steps = list(range(0, 3 * len(ys), 3))
    curve = summarize("s", "m", steps, ys, max_points=50)
    finite = [(y, s) for s, y in zip(steps, ys, strict=True) if math.isfinite(y)]
    assert curve.count == len(ys)
    assert curve.min == (min(finite, key=lambda p: p[0]) if finite else None)
    assert curve.max == (max(finite, key=lambda p: p[0]) if finite else None)
    assert len(curve.steps) == len(curve.values) <= 50
