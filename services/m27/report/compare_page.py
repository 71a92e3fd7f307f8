"""What a comparison draws and the page that shows it: the figures of a `Comparison`
(overlaid curves per metric, a parallel-coordinates plot of the varied values against the
first metric, a heat map where two values vary) and one self-contained HTML file with the
sortable table and the figures inline (Jinja2, every user string escaped).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import jinja2
from matplotlib.figure import Figure

from m27.plots import figures
from m27.report._style import CSS
from m27.report.compare import Comparison, Member, cells, header, numeric

MAX_CURVES: Final = 40  # more than this many members in one curve plot is a blur
_SLUG: Final = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Drawn:
    """One figure of a comparison: its file stem, its caption and the figure itself."""

    stem: str
    caption: str
    figure: Figure


def slug(text: str) -> str:
    """A metric or parameter name as part of a file name (no '/', no leading dot)."""
    return _SLUG.sub("_", text).lstrip(".")[:80] or "metric"


def draw(comparison: Comparison, members: Sequence[Member], *,
         width: figures.Width = "one") -> list[Drawn]:
    """The figures of `comparison`: per metric the members' curves overlaid (the best
    `MAX_CURVES` rows when there are more); with varied values, a parallel-coordinates plot
    of them against the best value of the first metric; with two or more, a heat map of it
    over the first two."""
    out: list[Drawn] = []
    order = {row.label: i for i, row in enumerate(comparison.rows)}
    ranked = sorted(members, key=lambda m: order.get(m.label, len(order)))[:MAX_CURVES]
    for name in comparison.metrics:
        lines = [figures.Curve(label=m.label, steps=m.curves[name].steps,
                               values=m.curves[name].values)
                 for m in ranked if name in m.curves]
        if lines:
            shown = "" if len(ranked) == len(members) else f" (the best {len(ranked)})"
            out.append(Drawn(f"curves-{slug(name)}", f"{name} by step, each member{shown}",
                             figures.curves(lines, metric=name, width=width)))
    if not comparison.metrics or not comparison.params or len(comparison.rows) < 2:
        return out
    metric = comparison.metrics[0]
    goal = comparison.goals[metric]
    column = f"best {metric}"
    rows: list[dict[str, float | str]] = []
    for row in comparison.rows:
        value = row.values.get(metric)
        if value is None or value.best is None:
            continue
        values = [row.params[k] for k in comparison.params]
        rows.append({**{k: (float(v) if numeric([v]) else v)
                        for k, v in zip(comparison.params, values, strict=True)},
                     column: value.best})
    out.append(Drawn(f"parallel-{slug(metric)}",
                     f"varied values against the best {metric} ({goal})",
                     figures.parallel_coordinates(rows, axes=comparison.params,
                                                  metric=column)))
    if len(comparison.params) >= 2:
        x, y = comparison.params[:2]
        out.append(Drawn(f"heatmap-{slug(metric)}",
                         f"best {metric} ({goal}) over {x} and {y}",
                         figures.heatmap(rows, x=x, y=y, metric=column, width=width)))
    return out


_ENV: Final = jinja2.Environment(
    loader=jinja2.PackageLoader("m27.report", "templates"),
    autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=False)


def page(comparison: Comparison, drawn: Sequence[Drawn], *, title: str, generated: str,
         notes: Sequence[str] = ()) -> str:
    """The comparison as one self-contained HTML file: its table (click a column to sort)
    and its figures as inline SVG."""
    svgs = [{"svg": _svg_body(figures.render(d.figure, "svg")), "caption": d.caption}
            for d in drawn]
    return _ENV.get_template("compare.html.j2").render(
        title=title, generated=generated, notes=list(notes), css=CSS,
        header=header(comparison), cells=cells(comparison),
        fixed=2 + len(comparison.params), params=comparison.params,
        metrics=comparison.metrics, goals=comparison.goals, rows=comparison.rows,
        figures=svgs)


def _svg_body(data: bytes) -> str:
    """The <svg> element of a standalone SVG file (no XML prolog or DOCTYPE inside HTML)."""
    text = data.decode("utf-8")
    start = text.find("<svg")
    return text[start:] if start >= 0 else ""
