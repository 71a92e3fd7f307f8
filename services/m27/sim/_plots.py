"""SVG plots of simulation runs, drawn by hand (no plotting library): utilization over time
and the CDF of job completion times. Pure: runs in, SVG text out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Final

from m27.sim._metrics import RawRun, jct_values

W: Final = 860
H: Final = 360
LEFT: Final = 64
RIGHT: Final = 150
TOP: Final = 24
BOTTOM: Final = 44
COLOURS: Final = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _frame(title: str, x_label: str, y_label: str, x_max: float, y_max: float,
           x_ticks: Sequence[float], y_ticks: Sequence[float], x_fmt: str) -> list[str]:
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for x in x_ticks:
        px = LEFT + pw * x / x_max
        out.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{TOP + ph}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{px:.1f}" y="{TOP + ph + 14}" text-anchor="middle">'
                   f'{x_fmt.format(x)}</text>')
    for y in y_ticks:
        py = TOP + ph - ph * y / y_max
        out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{LEFT + pw}" y2="{py:.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 8}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text x="14" y="{TOP + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {TOP + ph / 2})">{escape(y_label)}</text>')
    return out


def _ticks(top: float, count: int = 6) -> list[float]:
    if top <= 0:
        return [0.0]
    raw = top / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= step * mult:
            step *= mult
            break
    return [i * step for i in range(int(top / step) + 1)]


def _line(points: list[tuple[float, float]], x_max: float, y_max: float, colour: str,
          dash: str = "") -> str:
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    coords = " ".join(f"{LEFT + pw * x / x_max:.1f},{TOP + ph - ph * y / y_max:.1f}"
                      for x, y in points)
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline points="{coords}" fill="none" stroke="{colour}" '
            f'stroke-width="1.5"{extra}/>')


def _legend(labels: Sequence[tuple[str, str, str]]) -> list[str]:
    out = []
    for i, (label, colour, dash) in enumerate(labels):
        y = TOP + 12 + 16 * i
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{W - RIGHT + 10}" y1="{y}" x2="{W - RIGHT + 30}" y2="{y}" '
                   f'stroke="{colour}" stroke-width="2"{extra}/>')
        out.append(f'<text x="{W - RIGHT + 34}" y="{y + 4}">{escape(label)}</text>')
    return out


def utilization_svg(runs: Sequence[tuple[str, RawRun]]) -> str:
    """Busy share of all GPUs (solid) and goodput (dashed) per time bucket, per run."""
    x_max = max((r.span_s for _, r in runs), default=1.0) / 3600.0 or 1.0
    out = _frame("GPU utilization over time (simulated)", "hours", "% of GPUs", x_max, 100,
                 _ticks(x_max), _ticks(100, 5), "{:g}")
    legend = []
    for i, (label, raw) in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        busy = [(s.start_s / 3600.0, 100 * s.busy_gpus / raw.gpus) for s in raw.samples]
        work = [(s.start_s / 3600.0, 100 * s.work_gpus / raw.gpus) for s in raw.samples]
        out += [_line(busy, x_max, 100, colour), _line(work, x_max, 100, colour, "4 3")]
        legend += [(f"{label} busy", colour, ""), (f"{label} goodput", colour, "4 3")]
    return "\n".join([*out, *_legend(legend), "</svg>"]) + "\n"


def jct_cdf_svg(runs: Sequence[tuple[str, RawRun]]) -> str:
    """Share of completed jobs done within x hours of submission, per run."""
    values = {label: jct_values(raw) for label, raw in runs}
    x_max = max((v[-1] for v in values.values() if v), default=3600.0) / 3600.0 or 1.0
    out = _frame("Job completion time CDF (simulated)", "hours from submission",
                 "% of completed jobs", x_max, 100, _ticks(x_max), _ticks(100, 5), "{:g}")
    legend = []
    for i, (label, jcts) in enumerate(values.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = [(0.0, 0.0)]
        for k, v in enumerate(jcts, start=1):
            points.append((v / 3600.0, 100 * (k - 1) / len(jcts)))
            points.append((v / 3600.0, 100 * k / len(jcts)))
        out.append(_line(points, x_max, 100, colour))
        legend.append((label, colour, ""))
    return "\n".join([*out, *_legend(legend), "</svg>"]) + "\n"
