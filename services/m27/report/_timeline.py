"""The inline SVG timeline: one Gantt bar per started step on an axis of time since the start.

Pure geometry from the steps' `started_at`/`ended_at`; a step still without an end (a run
cancelled mid-step) is drawn to the run's end, translucent. Marks on a step's row show when
its checkpoints were committed (a tick) and when its training monitor saw an anomaly (a red
triangle), each with its text as a tooltip.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import msgspec

from m27.common.model import RunRecord
from m27.report._style import STATE_COLOURS, UNKNOWN_COLOUR
from m27.report._text import esc, fmt_seconds, fmt_span, fmt_time, shorten

WIDTH: Final = 960
LABEL_W: Final = 190
RIGHT_PAD: Final = 24
TOP: Final = 8
ROW_H: Final = 24
BAR_H: Final = 16
AXIS_H: Final = 28
LABEL_CHARS: Final = 26
MAX_TICKS: Final = 8
#: Tick spacings (seconds) a reader can add up: 1s … 1 day.
_NICE_STEPS: Final = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
    43200, 86400,
)


class Mark(msgspec.Struct, frozen=True, kw_only=True):
    """Something that happened to a step at `at` (unix seconds)."""

    at: float
    kind: Literal["checkpoint", "anomaly"]
    text: str


class Bar(msgspec.Struct, frozen=True, kw_only=True):
    """One step's bar, in seconds since the timeline's origin."""

    name: str
    state: str
    start: float
    end: float
    open: bool  # no recorded end: drawn to the run's end


def bars(run: RunRecord, *, generated_at: float) -> list[Bar]:
    """A bar for every step that started, in plan order, relative to the earliest start."""
    started = [s for s in run.steps if s.started_at is not None]
    if not started:
        return []
    origin = min(s.started_at for s in started if s.started_at is not None)
    fallback_end = run.ended_at if run.ended_at is not None else generated_at
    result = []
    for step in started:
        assert step.started_at is not None
        end = step.ended_at if step.ended_at is not None else fallback_end
        result.append(Bar(name=step.name, state=step.state, start=step.started_at - origin,
                          end=max(step.started_at, end) - origin, open=step.ended_at is None))
    return result


def tick_step(span: float) -> float:
    """The smallest nice spacing that needs at most MAX_TICKS intervals across `span`."""
    for step in _NICE_STEPS:
        if span / step <= MAX_TICKS:
            return float(step)
    return float(_NICE_STEPS[-1]) * math.ceil(span / _NICE_STEPS[-1] / MAX_TICKS)


def render_timeline(run: RunRecord, *, generated_at: float,
                    marks: Mapping[str, Sequence[Mark]] | None = None) -> str:
    """The `<svg>` element, or a short note when no step ever started; `marks` by step."""
    items = bars(run, generated_at=generated_at)
    if not items:
        return '<p class="muted">No step started, so there is no timeline.</p>'
    span = max((b.end for b in items), default=0.0) or 1.0
    scale = (WIDTH - LABEL_W - RIGHT_PAD) / span
    height = TOP + len(items) * ROW_H + AXIS_H
    parts = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" role="img" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'aria-label="Timeline of {len(items)} steps">',
        _axis(span, scale, rows_h=len(items) * ROW_H),
    ]
    parts.extend(_row(i, bar, scale) for i, bar in enumerate(items))
    origin = min(s.started_at for s in run.steps if s.started_at is not None)
    for i, bar in enumerate(items):
        parts.extend(_mark(i, m, (m.at - origin) * scale, span * scale)
                     for m in (marks or {}).get(bar.name, ()))
    parts.append("</svg>")
    caption = (f'<p class="muted">Time since the first step started '
               f"({esc(fmt_time(origin))}).</p>")
    return "\n".join(parts) + "\n" + caption + "\n" + _legend(items)


def _legend(items: list[Bar]) -> str:
    """The colours of the states that appear, in the order they first appear."""
    states = list(dict.fromkeys(bar.state for bar in items))
    badges = " ".join(f'<span class="badge state-{esc(s)}">{esc(s)}</span>' for s in states)
    return f'<p class="legend">{badges}</p>'


def _axis(span: float, scale: float, *, rows_h: int) -> str:
    step = tick_step(span)
    count = int(span / step + 1e-9)
    lines = ['<g class="axis">']
    for i in range(count + 1):
        x = LABEL_W + i * step * scale
        lines.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + rows_h}" '
                     f'stroke="#d1d9e0" stroke-width="1"></line>')
        lines.append(f'<text x="{x:.1f}" y="{TOP + rows_h + 18}" text-anchor="middle">'
                     f"{esc(_tick_label(i * step))}</text>")
    lines.append("</g>")
    return "\n".join(lines)


def _tick_label(seconds: float) -> str:
    return "0" if seconds == 0 else "+" + fmt_seconds(seconds)


def _row(index: int, bar: Bar, scale: float) -> str:
    y = TOP + index * ROW_H
    x = LABEL_W + bar.start * scale
    width = max(2.0, (bar.end - bar.start) * scale)
    colour = STATE_COLOURS.get(bar.state, UNKNOWN_COLOUR)
    classes = f"bar state-{esc(bar.state)}" + (" open" if bar.open else "")
    duration = fmt_span(bar.start, None if bar.open else bar.end)
    tooltip = f"{bar.name}: {bar.state}, {duration}"
    return (
        f'<text x="{LABEL_W - 8}" y="{y + ROW_H / 2 + 4:.1f}" text-anchor="end">'
        f"<title>{esc(bar.name)}</title>{esc(shorten(bar.name, LABEL_CHARS))}</text>\n"
        f'<rect class="{classes}" x="{x:.1f}" y="{y + (ROW_H - BAR_H) / 2:.1f}" '
        f'width="{width:.1f}" height="{BAR_H}" rx="3" fill="{colour}">'
        f"<title>{esc(tooltip)}</title></rect>"
    )


def _mark(index: int, mark: Mark, x: float, right: float) -> str:
    """A checkpoint tick across the row's bar, or an anomaly's triangle above it."""
    x = LABEL_W + min(max(x, 0.0), right)
    y = TOP + index * ROW_H
    tip = f"<title>{esc(mark.text)}</title>"
    if mark.kind == "checkpoint":
        return (f'<line class="mark checkpoint" x1="{x:.1f}" y1="{y + 3:.1f}" x2="{x:.1f}" '
                f'y2="{y + ROW_H - 3:.1f}" stroke="#ffffff" stroke-width="2">{tip}</line>')
    return (f'<path class="mark anomaly" d="M{x - 5:.1f} {y + 1:.1f} L{x + 5:.1f} {y + 1:.1f} '
            f'L{x:.1f} {y + 9:.1f} Z" fill="#cf222e">{tip}</path>')
