"""The training monitor's detector (pure): is the newest logged value of a metric abnormal?

`observe(state, spec, step, value)` takes one value of the metric a `MonitorSpec` names and
returns the next state and the anomalies this value starts. Kinds, for a metric where lower
is better (`mode: min`; `max` mirrors every comparison):

- `nan`: the value is NaN or ±Infinity.
- `spike`: above the rolling median of the last `window` finite values by more than
  `spike` robust standard deviations (1.4826 · the median absolute deviation, and never
  less than 1 % of |median|, so a flat curve's last digits are not a spike), once `warmup`
  values were seen. The median moves little for one outlier, so the spike itself is kept in
  the window.
- `divergence`: worse than the value before it `divergence` times in a row (a noisy but
  healthy curve almost never does this: i.i.d. noise rises 10 times in a row with
  probability 1/11!).
- `plateau`: `plateau` values in a row without a new best (better than the best so far by
  more than `min_delta` × |best|).

Each kind is reported once per episode: a spike that lasts 30 points is one anomaly, and
so is a loss that jumps, falls back and jumps again while it recovers; an episode ends
after `warmup` values in a row for which the condition did not hold (finite values, values
inside the band, values no worse than the one before, new bests), and then the kind can
fire again. Values that are not numbers at all never reach here
(`metric_points.parse_line` refused their line).
"""

from __future__ import annotations

import math
from statistics import median
from typing import Final

import msgspec

from m27.common.model import AnomalyKind, MonitorSpec

#: 1.4826 · MAD estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA: Final = 1.4826
#: The spike band is at least this share of |median| wide per standard deviation.
MIN_RELATIVE_SIGMA: Final = 0.01


class Anomaly(msgspec.Struct, frozen=True, kw_only=True):
    """What the detector saw: the kind, the training step and value that started it, and
    what it was measured against (the median for a spike, the value before for a
    divergence, the best for a plateau; None for a NaN)."""

    kind: AnomalyKind
    metric: str
    step: int
    value: float
    baseline: float | None
    detail: str


class MonitorState(msgspec.Struct, frozen=True, kw_only=True):
    """What the detector remembers of one metric of one attempt."""

    recent: tuple[float, ...] = ()  # the last `window` finite values, oldest first
    seen: int = 0  # finite values so far
    previous: float | None = None
    worse_run: int = 0
    best: float | None = None
    since_best: int = 0
    #: Kinds in an episode → values in a row since the condition last held.
    episodes: dict[AnomalyKind, int] = msgspec.field(default_factory=dict)


def value_of(raw: float | str) -> float:
    """A logged value as a float ("NaN", "Infinity" and "-Infinity" are the strings JSON
    needs for what is not finite)."""
    return float(raw)


def observe(state: MonitorState, spec: MonitorSpec, step: int, value: float
            ) -> tuple[MonitorState, tuple[Anomaly, ...]]:
    """The next state after `value` (logged at training `step`) and the anomalies it
    starts."""
    if not math.isfinite(value):
        found = Anomaly(kind="nan", metric=spec.metric, step=step, value=value,
                        baseline=None, detail=f"{spec.metric} is {value} at step {step}")
        episodes, started = _episodes(state.episodes, {"nan": found}, spec)
        return msgspec.structs.replace(state, episodes=episodes), started
    sign = 1.0 if spec.mode == "min" else -1.0  # > 0: worse
    episodes, started = _episodes(state.episodes, {
        "nan": None,
        "spike": _spike(state, spec, step, value, sign),
        "divergence": _divergence(state, spec, step, value, sign),
        "plateau": _plateau(state, spec, step, value, sign),
    }, spec)
    improved = state.best is None or sign * (value - state.best) < -spec.min_delta * abs(
        state.best)
    worse = state.previous is not None and sign * (value - state.previous) > 0
    window = max(1, spec.window)
    return MonitorState(
        recent=(*state.recent, value)[-window:], seen=state.seen + 1, previous=value,
        worse_run=state.worse_run + 1 if worse else 0,
        best=value if improved else state.best,
        since_best=0 if improved else state.since_best + 1,
        episodes=episodes), started


def _episodes(episodes: dict[AnomalyKind, int], held: dict[AnomalyKind, Anomaly | None],
              spec: MonitorSpec) -> tuple[dict[AnomalyKind, int], tuple[Anomaly, ...]]:
    """The episodes after one value (`held`: each kind's anomaly, None where its condition
    does not hold; kinds not named are left as they are) and the anomalies that start one."""
    after = dict(episodes)
    started: list[Anomaly] = []
    for kind, found in held.items():
        if found is not None:
            if kind not in after:
                started.append(found)
            after[kind] = 0
        elif kind in after:
            after[kind] += 1
            if after[kind] >= max(1, spec.warmup):
                del after[kind]
    return after, tuple(started)


def _spike(state: MonitorState, spec: MonitorSpec, step: int, value: float, sign: float
           ) -> Anomaly | None:
    if spec.spike <= 0 or state.seen < max(1, spec.warmup) or not state.recent:
        return None
    center = median(state.recent)
    mad = median(abs(v - center) for v in state.recent)
    sigma = max(MAD_TO_SIGMA * mad, MIN_RELATIVE_SIGMA * abs(center), 1e-12)
    distance = sign * (value - center) / sigma
    if distance <= spec.spike:
        return None
    return Anomaly(kind="spike", metric=spec.metric, step=step, value=value, baseline=center,
                   detail=f"{spec.metric} {value:.6g} at step {step} is {distance:.1f} robust "
                   f"standard deviations {'above' if sign > 0 else 'below'} the median "
                   f"{center:.6g} of the last {len(state.recent)} values (limit {spec.spike:g})")


def _divergence(state: MonitorState, spec: MonitorSpec, step: int, value: float,
                sign: float) -> Anomaly | None:
    if spec.divergence <= 0 or state.previous is None or sign * (value - state.previous) <= 0:
        return None
    if state.worse_run + 1 < spec.divergence:
        return None
    direction = "risen" if sign > 0 else "fallen"
    return Anomaly(kind="divergence", metric=spec.metric, step=step, value=value,
                   baseline=state.previous,
                   detail=f"{spec.metric} has {direction} {state.worse_run + 1} times in a row, "
                   f"to {value:.6g} at step {step}")


def _plateau(state: MonitorState, spec: MonitorSpec, step: int, value: float, sign: float
             ) -> Anomaly | None:
    if spec.plateau <= 0 or state.best is None:
        return None
    if sign * (value - state.best) < -spec.min_delta * abs(state.best):
        return None  # a new best
    if state.since_best + 1 < spec.plateau:
        return None
    return Anomaly(kind="plateau", metric=spec.metric, step=step, value=value,
                   baseline=state.best,
                   detail=f"{spec.metric} has not improved on {state.best:.6g} for "
                   f"{state.since_best + 1} values (step {step})")
