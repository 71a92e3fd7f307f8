"""Training metrics as lines and as series (pure): the `$M27_METRICS_FILE` format, and how
the attempts of one step make one series.

The file holds one JSON object per line, written by `m27.train.log` or by any program:

    {"step": 120, "loss": 0.41, "acc": 0.83}
    {"step": 130, "t": 1764578123.4, "loss": NaN}

`step` (an integer ≥ 0) is the training step; `t`, optional, the wall time in Unix
seconds (else the time the node-agent read the line); every other key is a metric whose
value is a number. `NaN`, `Infinity` and `-Infinity` (as Python's json writes them) and
`null` (read as NaN) are kept, so a monitor sees a loss that became NaN. A line that is not
of this form is skipped and counted, never fatal; a line longer than MAX_LINE_BYTES too.

A step's attempts make one series (`series`): an attempt that resumed from a checkpoint
logs again from the step it resumed at, and its points replace those of earlier attempts
from that step on, so nothing is counted twice and nothing the later attempt redid stays.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Final

from m27.common.events import MetricPoint

MAX_LINE_BYTES: Final = 64 * 1024
MAX_METRICS_PER_LINE: Final = 200
#: A metric's name: what plots and tables show.
METRIC_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,99}")
RESERVED: Final = frozenset({"step", "t"})
NON_FINITE: Final = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def metric_problem(name: str, value: object) -> str:
    """Why `name: value` is not a metric, or ''."""
    if name in RESERVED or not METRIC_NAME_RE.fullmatch(name):
        return (f"metric name {name[:100]!r}: use letters, digits and _ . / - (at most 100), "
                "not 'step' or 't'")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"metric {name}: {type(value).__name__} is not a number"
    return ""


def encode_value(value: float) -> float | str:
    """A float as a metric value: itself, or NaN/Infinity/-Infinity spelled out."""
    return value if math.isfinite(value) else NON_FINITE[repr(float(value))]


def _constant(text: str) -> float:
    return float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[text])


def parse_line(line: bytes, read_at: float) -> MetricPoint | str:
    """One line of a metrics file as a point, or the problem with it (a short text)."""
    if len(line) > MAX_LINE_BYTES:
        return f"a line longer than {MAX_LINE_BYTES // 1024} KiB"
    try:
        data = json.loads(line, parse_constant=_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "not JSON"
    if not isinstance(data, dict):
        return "not a JSON object"
    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return "no integer `step` ≥ 0"
    at = data.get("t", read_at)
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        return "`t` is not a time in seconds"
    metrics = {k: v for k, v in data.items() if k not in RESERVED}
    if not metrics:
        return "no metric"
    if len(metrics) > MAX_METRICS_PER_LINE:
        return f"more than {MAX_METRICS_PER_LINE} metrics"
    values: dict[str, float | str] = {}
    for name, value in metrics.items():
        if value is None:
            value = math.nan
        problem = metric_problem(name, value)
        if problem:
            return problem
        values[name] = encode_value(float(value))
    return MetricPoint(step=step, at=float(at), values=values)


def series(attempts: Mapping[int, Iterable[MetricPoint]]) -> list[MetricPoint]:
    """One step's points across its attempts, by training step: each attempt's points
    replace those of earlier attempts from its first logged step on (it resumed there);
    within an attempt, a step logged twice keeps its last point."""
    merged: dict[int, MetricPoint] = {}
    for attempt in sorted(attempts):
        points = list(attempts[attempt])
        if not points:
            continue
        start = min(p.step for p in points)
        merged = {step: p for step, p in merged.items() if step < start}
        for point in points:
            merged[point.step] = point
    return [merged[step] for step in sorted(merged)]
