"""The run report: one self-contained HTML page (inline CSS and SVG, no scripts or assets),
from a Jinja2 template (`templates/run_report.html.j2`).

Pure: the same run, evidence and `generated_at` always give the same bytes, so reports can
be diffed and tests can pin them. Every user-controlled string is escaped: the template
autoescapes, and every value it prints is first cleaned of control characters
(`m27.report._text.clean`); the few HTML fragments made here (`Markup`) escape their parts
with `esc`. The evidence (`m27.report.evidence`: curves, GPU readings, checkpoints,
anomalies from the history store) adds a results table, per-step figures and marks on the
timeline; without it the report is what the run record alone says.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final, get_args
from urllib.parse import quote

import jinja2
from markupsafe import Markup

from m27 import __version__
from m27.common.model import RunRecord, StepRecord, StepState
from m27.common.proto import MASKED
from m27.plots import figures
from m27.report import efficiency
from m27.report._style import CSS
from m27.report._text import NO_VALUE, clean, clean_tail, esc, fmt_span, fmt_time, iso_time
from m27.report._timeline import Mark, render_timeline
from m27.report.compare import goal_of, number
from m27.report.evidence import GpuTrace, RunEvidence, StepEvidence

#: The order states are counted in the summary line: outcomes first.
SUMMARY_ORDER: Final[tuple[StepState, ...]] = (
    "succeeded", "failed", "cancelled", "skipped", "running", "retrying", "queued", "pending",
)
assert set(SUMMARY_ORDER) == set(get_args(StepState)), "a step state is missing"
#: Steps whose output is shown unfolded: the ones a reader opens the report for.
OPEN_STATES: Final = frozenset({"failed"})
_TABLE_HEAD: Final = (
    "Step", "Type", "State", "Node", "GPUs", "Attempt", "Started", "Duration", "GPU energy",
    "Work per energy", "Exit", "Reason",
)
MAX_METRIC_FIGURES: Final = 8  # per step; every metric is in the results table
#: A GPU's curves are drawn when some GPU the step held has at least this many readings: a
#: line through one or two says nothing its numbers in the table do not, and three SVGs per
#: short step were most of the report service's CPU in the soak (docs/reliability.md).
MIN_GPU_CURVE_POINTS: Final = 3
MAX_FIGURES: Final = 120  # per report: drawing is the slow part of writing one


def _html(fragment: str) -> Markup:
    """HTML made here, trusted as it is: every user string in it went through `esc`, and
    figures are matplotlib's SVG, which escapes the text it draws."""
    return Markup(fragment)  # noqa: S704


def _finalize(value: Any) -> Any:
    """Every printed value: markup as it is, text without control characters."""
    if isinstance(value, Markup) or not isinstance(value, str):
        return value
    return clean(value)


_ENV: Final = jinja2.Environment(
    loader=jinja2.PackageLoader("m27.report", "templates"), autoescape=True,
    undefined=jinja2.StrictUndefined, finalize=_finalize, keep_trailing_newline=True)
_ENV.filters["tail"] = clean_tail


def render_run_report(run: RunRecord, *, generated_at: float,
                      evidence: RunEvidence | None = None) -> str:
    """The whole HTML document for `run`, stamped as generated at `generated_at`."""
    evidence = evidence or RunEvidence()
    budget = [MAX_FIGURES]
    notes = [run.reason] if run.reason else []
    if any(step.gpu_simulated for step in run.steps):
        notes.append(_html("Some steps ran on <strong>simulated</strong> GPUs, not real "
                            "hardware."))
    return _ENV.get_template("run_report.html.j2").render(
        version=__version__, css=_html(CSS), run=run, meta=_meta(run), notes=notes,
        summary=summary_line(run.steps), table_head=_TABLE_HEAD, dash=NO_VALUE,
        rows=[_row(step, evidence.of(step.name)) for step in run.steps],
        results=_results(run, evidence),
        timeline=_html(render_timeline(run, generated_at=generated_at,
                                        marks=_marks(run, evidence))),
        details=[_detail(run, i, step, evidence.of(step.name), budget)
                 for i, step in enumerate(run.steps)],
        generated=fmt_time(generated_at))


def summary_line(steps: tuple[StepRecord, ...]) -> str:
    """`5 steps: 3 succeeded, 1 failed, 1 skipped` (plain text, not escaped)."""
    if not steps:
        return "No steps."
    counts = Counter(step.state for step in steps)
    parts = [f"{counts[state]} {state}" for state in SUMMARY_ORDER if counts[state]]
    noun = "step" if len(steps) == 1 else "steps"
    return f"{len(steps)} {noun}: {', '.join(parts)}"


def _time(ts: float | None) -> Markup:
    if ts is None:
        return _html(NO_VALUE)
    return _html(f'<time datetime="{iso_time(ts)}">{esc(fmt_time(ts))}</time>')


def _meta(run: RunRecord) -> list[tuple[str, Markup | str]]:
    return [
        ("Run id", _html(f"<code>{esc(run.run_id)}</code>")),
        ("User", run.user or NO_VALUE),
        ("Urgency", run.urgency),
        ("Duration", fmt_span(run.started_at, run.ended_at)),
        ("Created", _time(run.created_at or None)),  # 0: unknown (proto)
        ("Started", _time(run.started_at)),
        ("Ended", _time(run.ended_at)),
        ("Workdir", _html(f"<code>{esc(run.workdir)}</code>") if run.workdir else NO_VALUE),
    ]


def _row(step: StepRecord, evidence: StepEvidence) -> dict[str, Any]:
    work = efficiency.describe(efficiency.work_counters(evidence.curves), step.energy_j,
                               simulated=step.gpu_simulated)
    return {"step": step, "gpus": _html(gpus_cell(step)), "started": _time(step.started_at),
            "duration": fmt_span(step.started_at, step.ended_at), "energy": _energy(step),
            "work": work or NO_VALUE, "exit": _exit_code(step.exit_code)}


def gpus_cell(step: StepRecord) -> str:
    """GPU ids and the share held, labelled when the GPUs are simulated (HTML)."""
    sim = (' <span class="sim" title="not real hardware">simulated</span>'
           if step.gpu_simulated else "")
    if not step.gpu_ids and not step.gpu_share:
        return NO_VALUE + sim
    ids = ", ".join(str(i) for i in step.gpu_ids) or "?"
    noun = "GPU" if len(step.gpu_ids) <= 1 else "GPUs"
    share = f' <span class="muted">· share {step.gpu_share:g}</span>' if step.gpu_share else ""
    return f"{noun} {ids}{share}{sim}"


def _energy(step: StepRecord) -> str:
    """Its share of its GPUs' energy; modelled, and marked so, on simulated GPUs."""
    if not step.energy_j:
        return NO_VALUE
    value = f"{step.energy_j / 1000:.1f} kJ" if step.energy_j >= 1000 else \
        f"{step.energy_j:.0f} J"
    return value + (" (simulated)" if step.gpu_simulated else "")


def _exit_code(code: int | None) -> Markup:
    if code is None:
        return _html(NO_VALUE)
    return _html(f'<span class="exit-bad">{code}</span>' if code != 0 else "0")


def _results(run: RunRecord, evidence: RunEvidence) -> list[dict[str, Any]]:
    """Per step and metric: final and best (by the metric's goal) over every point."""
    out = []
    for index, step in enumerate(run.steps):
        for curve in evidence.of(step.name).curves:
            goal = goal_of(curve.name, {})
            best = curve.best(goal)
            out.append({"index": index, "step": step.name, "metric": curve.name,
                        "final": number(curve.last), "final_step": curve.last_step,
                        "best": number(None if best is None else best[0]),
                        "best_step": NO_VALUE if best is None else best[1], "goal": goal,
                        "count": curve.count})
    return out


def _marks(run: RunRecord, evidence: RunEvidence) -> dict[str, list[Mark]]:
    out: dict[str, list[Mark]] = {}
    for step in run.steps:
        found = evidence.of(step.name)
        marks = [Mark(at=c.at, kind="checkpoint",
                      text=f"checkpoint (attempt {c.attempt}"
                      + (f", training step {c.train_step})" if c.train_step is not None
                         else ")")) for c in found.checkpoints]
        marks += [Mark(at=a.at, kind="anomaly",
                       text=f"{a.kind} in {a.metric} at training step {a.train_step}")
                  for a in found.anomalies]
        if marks:
            out[step.name] = marks
    return out


@dataclass(frozen=True)
class _Figure:
    svg: Markup
    caption: str


def _svg(fig: Any) -> Markup:
    """A figure as an inline `<svg>` element (matplotlib escapes the text it draws)."""
    text = figures.render(fig, "svg").decode("utf-8")
    return _html(text[text.find("<svg"):])


def _detail(run: RunRecord, index: int, step: StepRecord, found: StepEvidence,
            budget: list[int]) -> dict[str, Any]:
    shown = {**step.env, **dict.fromkeys(step.secret_env, MASKED)}
    facts = []
    if step.exit_code is not None:
        facts.append(f"exit {step.exit_code}")
    if step.started_at is not None and step.ended_at is not None:
        facts.append(fmt_span(step.started_at, step.ended_at))
    if step.node_id:
        facts.append(f"on {step.node_id}")
    drawn = [c for c in found.curves if c.steps][:MAX_METRIC_FIGURES]
    metric_figures = [_Figure(_svg(figures.curves(
        [figures.Curve(label=f"{step.name} · {c.name}", steps=c.steps, values=c.values)],
        metric=c.name)), f"{c.name} by training step ({c.count} points)")
        for c in _take(drawn, budget)]
    gpu_figures = _gpu_figures(found.gpus, budget, simulated=step.gpu_simulated)
    gpu_rows = _gpu_rows(found.gpus)
    return {
        "index": index, "step": step, "open": step.state in OPEN_STATES,
        "facts": " · ".join(facts), "drawn": bool(metric_figures or gpu_rows),
        "env": sorted(shown.items()), "outputs": _outputs(run, step),
        "attempts": [_attempt(a) for a in step.history],
        "figures": metric_figures,
        "more_metrics": max(0, len(found.curves) - len(metric_figures)),
        "gpu_figures": gpu_figures,
        "gpu_rows": gpu_rows,
        "gpu_simulated": step.gpu_simulated,
        "checkpoints": [{"at": _time(c.at), "attempt": c.attempt,
                         "step": NO_VALUE if c.train_step is None else c.train_step,
                         "size": _bytes(c.size_bytes), "new": _bytes(c.new_bytes),
                         "id": c.checkpoint_id[:16]} for c in found.checkpoints],
        "anomalies": [{"at": _time(a.at), "attempt": a.attempt, "metric": a.metric,
                       "kind": a.kind, "step": a.train_step, "value": number(a.value),
                       "baseline": number(a.baseline), "actions": a.actions}
                      for a in found.anomalies],
    }


def _take(items: Sequence[Any], budget: list[int]) -> Sequence[Any]:
    """As many of `items` as the report's figure budget still allows (and spend it)."""
    taken = items[:max(0, budget[0])]
    budget[0] -= len(taken)
    return taken


def _gpu_figures(traces: Sequence[GpuTrace], budget: list[int], *,
                 simulated: bool) -> list[_Figure]:
    """Utilisation, memory and temperature of the GPUs the step held, over minutes since
    it first held one; a line per attempt and GPU (simulated GPUs say so)."""
    traces = [t for t in traces if t.points]
    if not traces or budget[0] < 3 or max(len(t.points) for t in traces) < MIN_GPU_CURVE_POINTS:
        return []
    origin = min(t.first_at for t in traces)
    out = []
    for metric, unit, value in (
            ("GPU utilisation", "%", lambda p: p.utilization_pct),
            ("GPU memory used", "MiB", lambda p: float(p.memory_used_mb)),
            ("GPU temperature", "°C", lambda p: p.temperature_c)):
        lines = [figures.Curve(label=t.label,
                               steps=[(p.at - origin) / 60.0 for p in t.points],
                               values=[value(p) for p in t.points]) for t in traces]
        out.append(_Figure(_svg(figures.curves(lines, metric=f"{metric} ({unit})",
                                               xlabel="minutes since the step first held "
                                               "a GPU")),
                           metric + (" (simulated GPUs: modelled, not measured)"
                                     if simulated else "")))
    budget[0] -= 3
    return out


def _gpu_rows(traces: Sequence[GpuTrace]) -> list[dict[str, str]]:
    """Each GPU the step held, in numbers: readings, mean and highest utilisation, highest
    memory and temperature over its span."""
    rows = []
    for t in traces:
        if not t.points:
            continue
        util = [p.utilization_pct for p in t.points]
        rows.append({"gpu": t.label, "share": number(t.share), "readings": str(len(t.points)),
                     "util_mean": number(sum(util) / len(util)), "util_max": number(max(util)),
                     "memory_max": str(max(p.memory_used_mb for p in t.points)),
                     "temperature_max": number(max(p.temperature_c for p in t.points))})
    return rows


def _attempt(a: Any) -> dict[str, Any]:
    return {"attempt": a.attempt, "node_id": a.node_id, "started": _time(a.started_at),
            "ended": _time(a.ended_at), "exit": _exit_code(a.exit_code), "cause": a.cause,
            "reason": a.reason}


def _outputs(run: RunRecord, step: StepRecord) -> list[dict[str, str]]:
    """Declared outputs, each linked (`file://`) where its absolute path is known."""
    out = []
    for path in step.outputs:
        where = PurePosixPath(path)
        base = step.workdir or run.workdir
        if not where.is_absolute() and base and PurePosixPath(base).is_absolute():
            where = PurePosixPath(base) / where
        href = "file://" + quote(clean(str(where))) if where.is_absolute() else ""
        out.append({"path": path, "href": href})
    return out


def _bytes(size: int) -> str:
    if size <= 0:
        return "0 B"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = min(len(units) - 1, int(math.log(size, 1024)))
    return f"{size / 1024 ** power:.1f} {units[power]}" if power else f"{size} B"
