"""One metric's curve as the API and the figures carry it (pure): a summary over every
point, and a thinned copy for drawing.

Thinning keeps what a reader looks for in a training curve: its shape, and its outliers.
The points between the first and the last are cut into equal runs of steps, and each run
keeps its lowest and its highest finite value and its first non-finite one, so a loss spike
or a NaN is never thinned away; the first and the last point always stay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec

DEFAULT_POINTS: Final = 1000
MIN_POINTS: Final = 5  # the ends, and one run's lowest, highest and odd value
MAX_POINTS: Final = 10_000


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    """One metric of one step: `steps` increasing, `values` as logged (NaN kept), and the
    summary of the whole series (`count` points before thinning)."""

    step: str
    name: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    count: int
    last: float
    last_step: int
    last_at: float = 0.0
    #: lowest and highest finite value with their steps; None when no value is finite
    min: tuple[float, int] | None = None
    max: tuple[float, int] | None = None

    def best(self, goal: str) -> tuple[float, int] | None:
        """The best finite value and its step: the lowest for goal "min", else the highest."""
        return self.min if goal == "min" else self.max


def points_asked(max_points: int) -> int:
    """The request's `max_points` as used: 0 is the default, and it is kept in 5..10000."""
    if max_points <= 0:
        return DEFAULT_POINTS
    return min(max(max_points, MIN_POINTS), MAX_POINTS)


def summarize(step: str, name: str, steps: Sequence[int], values: Sequence[float],
              last_at: float = 0.0, max_points: int = DEFAULT_POINTS) -> Curve:
    """The curve of `(steps, values)` (ordered by step): its summary over every point and
    at most `max_points` of them."""
    low = high = None
    for s, v in zip(steps, values, strict=True):
        if math.isfinite(v):
            if low is None or v < low[0]:
                low = (v, s)
            if high is None or v > high[0]:
                high = (v, s)
    keep = thin(values, max_points)
    return Curve(step=step, name=name, steps=tuple(steps[i] for i in keep),
                 values=tuple(values[i] for i in keep), count=len(values),
                 last=values[-1] if values else math.nan,
                 last_step=steps[-1] if steps else 0, last_at=last_at, min=low, max=high)


def thin(values: Sequence[float], max_points: int) -> list[int]:
    """Indices of at most `max_points` of `values` to draw: all of them when they fit;
    else the first, the last, and per equal run of the points between, its lowest and
    highest finite value and its first non-finite one (none below `MIN_POINTS`)."""
    n = len(values)
    if n <= max_points:
        return list(range(n))
    runs = (max_points - 2) // 3
    if runs < 1:
        return [0, n - 1][:max(max_points, 0)]
    inner = n - 2
    keep = {0, n - 1}
    for r in range(runs):
        lo, hi = 1 + r * inner // runs, 1 + (r + 1) * inner // runs
        finite = [i for i in range(lo, hi) if math.isfinite(values[i])]
        if finite:
            keep.add(min(finite, key=lambda i: values[i]))
            keep.add(max(finite, key=lambda i: values[i]))
        odd = next((i for i in range(lo, hi) if not math.isfinite(values[i])), None)
        if odd is not None:
            keep.add(odd)
    return sorted(keep)
