"""What a run looks like on a phone: its main curve as a small PNG, its key metrics as a line.

Used by notifications (a finished run's message) and the Telegram bot (`/report`). Pure
apart from drawing (matplotlib is not thread-safe: callers draw under one lock, as the
report service does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from m27.common.curves import Curve
from m27.plots import figures

#: Metrics a reader looks for first, in this order; otherwise the first one logged.
PREFERRED: Final = ("loss", "train_loss", "val_loss", "accuracy", "acc")
MAX_KEY_METRICS: Final = 6
MAX_CURVES: Final = 6


def main_metric(curves: Sequence[Curve]) -> str | None:
    """The metric a phone shows: `loss` (or another of PREFERRED), else the first."""
    names = [curve.name for curve in curves]
    for wanted in PREFERRED:
        if wanted in names:
            return wanted
    return names[0] if names else None


def key_metrics(curves: Sequence[Curve]) -> dict[str, float]:
    """The last value of up to MAX_KEY_METRICS metrics (`step/name` when several steps
    log the same name), main metric first; non-finite values kept (NaN says much)."""
    main = main_metric(curves)
    ordered = sorted(curves, key=lambda c: (c.name != main, c.step, c.name))
    steps_of: dict[str, set[str]] = {}
    for curve in curves:
        steps_of.setdefault(curve.name, set()).add(curve.step)
    out: dict[str, float] = {}
    for curve in ordered:
        if len(out) == MAX_KEY_METRICS:
            break
        key = curve.name if len(steps_of[curve.name]) == 1 else f"{curve.step}/{curve.name}"
        out[key] = curve.last
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """`loss 0.412 · acc 0.913` (NaN as NaN)."""
    return " · ".join(f"{name} {_number(value)}" for name, value in metrics.items())


def _number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def curve_png(curves: Sequence[Curve], *, title: str) -> bytes | None:
    """The main metric of every step that logs it, as one PNG; None when nothing was
    logged (blocking: draw under the caller's lock)."""
    metric = main_metric(curves)
    if metric is None:
        return None
    lines = [figures.Curve(label=curve.step, steps=curve.steps, values=curve.values)
             for curve in curves if curve.name == metric][:MAX_CURVES]
    fig = figures.curves(lines, metric=metric, title=title)
    return figures.render(fig, "png")
