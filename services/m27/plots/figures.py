"""Publication-quality figures (curves, parallel coordinates, heatmaps) as reproducible bytes.

Figures are built with matplotlib's object-oriented API only (no pyplot, so no windows and no
global figure registry) under one fixed rc style, so a figure looks the same whatever the
caller's matplotlibrc says. `render` fixes the SVG hash salt and drops the dates, so the same
inputs give the same bytes in every process: reports can be diffed and cached by content.

Every label is a user string (metric names, run ids, parameter values): it is cleaned of
control characters, shortened, and drawn with mathtext off, so `loss$x^2$` stays literal.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import matplotlib.style
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_pdf import FigureCanvasPdf
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.cm import ScalarMappable
from matplotlib.collections import LineCollection
from matplotlib.colorbar import Colorbar
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

Width = Literal["one", "two"]
Format = Literal["svg", "pdf", "png"]
Row = Mapping[str, float | str]

#: IEEE/ACM column widths in inches.
WIDTHS: Final[dict[str, float]] = {"one": 3.5, "two": 7.16}
_MAX_HEIGHT: Final[dict[str, float]] = {"one": 3.2, "two": 4.5}
_RATIO: Final = 0.62
MAX_LABEL: Final = 60
#: Category names on an axis are shorter still: a column is only 3.5 in wide.
MAX_TICK_LABEL: Final = 24
#: Beyond this the axis span (with margins and tick padding) overflows to inf.
_PLOTTABLE: Final = 1e250
#: The same for a log axis, whose ticks may lie several decade strides past the data.
_PLOTTABLE_LOG: Final = 1e150
PNG_DPI: Final = 150
#: More legend entries than this go below the axes instead of over the data.
_LEGEND_INSIDE_MAX: Final = 6
#: A positive numeric axis whose max/min is at least this is spread by decades.
_LOG_RATIO: Final = 100.0
#: Above this many cells a heatmap is too dense to read numbers in.
_MAX_ANNOTATED_CELLS: Final = 400

#: Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
OKABE_ITO: Final = (
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000",
)
_LINESTYLES: Final = ("-", "--", ":", "-.")

#: Applied over matplotlib's defaults, so the caller's matplotlibrc never changes the output.
_RC: Final[dict[str, Any]] = {
    "font.family": ["DejaVu Sans"],  # ships with matplotlib: same glyphs on every machine
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "legend.frameon": False,
    "axes.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#d9d9d9",
    "grid.linewidth": 0.4,
    "lines.linewidth": 1.0,
    "lines.markersize": 3,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "figure.dpi": 100,
    "text.usetex": False,
    "axes.formatter.use_mathtext": False,
    "svg.hashsalt": "m27",  # fixed ids for clip paths and hatches: byte-identical SVG
    "svg.fonttype": "none",  # text stays <text>: searchable, selectable, small
    "svg.image_inline": True,
    "pdf.fonttype": 42,  # embedded TrueType: text stays editable in a PDF editor
    "pdf.compression": 6,
}

_METADATA: Final[dict[str, dict[str, str | None]]] = {
    "svg": {"Date": None, "Creator": "m27"},
    "pdf": {"CreationDate": None, "ModDate": None, "Creator": "m27"},
    "png": {"Software": "m27"},
}

# Controls (XML 1.0 and PDF strings cannot carry them), bidi overrides, lone surrogates
# (not encodable as UTF-8) and the XML non-characters U+FFFE/U+FFFF.
_UNSAFE_RE: Final = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff\ufffe\uffff]"
)
_SPACE_RE: Final = re.compile("[\t\n\r]+")


@dataclass(frozen=True, slots=True)
class Curve:
    """One line of a `curves` figure; non-finite values are allowed and left out when drawn."""

    label: str
    steps: Sequence[float]
    values: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"curve {self.label!r}: {len(self.steps)} steps but {len(self.values)} values"
            )


# --- text and style -----------------------------------------------------------------------


def label(text: object, limit: int = MAX_LABEL) -> str:
    """A user string made safe to draw: no control characters, one line, at most 60 chars."""
    clean = _SPACE_RE.sub(" ", _UNSAFE_RE.sub("", str(text)))
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def _num(value: float) -> str:
    """A parameter value or axis bound, short but not rounded past recognition."""
    return f"{value:.4g}"


@contextlib.contextmanager
def _style() -> Iterator[None]:
    """matplotlib's defaults plus `_RC`, restored on exit (and quiet about missing glyphs)."""
    with matplotlib.style.context(["default", _RC]), warnings.catch_warnings():
        # A glyph DejaVu Sans lacks (CJK, emoji) is drawn as a box; that is not an error.
        warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)
        warnings.filterwarnings("ignore", message="Matplotlib currently does not support")
        yield


def _figure(width: Width, *, ratio: float = _RATIO, extra_height: float = 0.0) -> Figure:
    w = WIDTHS[width]
    h = min(w * ratio, _MAX_HEIGHT[width]) + extra_height
    return Figure(figsize=(w, h), layout="constrained")


def _frozen(fig: Figure) -> Figure:
    """Lay the figure out once, now, and keep that layout.

    Constrained layout starts from the current positions, so each draw moves things by a
    hair: left on, the second render of a figure would differ from the first.
    """
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    return fig


def _note(fig: Figure, ax: Axes, text: str) -> Figure:
    """An empty plot that says why it is empty (better than a blank box in a report)."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes,
            parse_math=False, color="#59636e")
    return _frozen(fig)


# --- curves -------------------------------------------------------------------------------


def _finite_xy(curve: Curve, *, log_y: bool) -> tuple[np.ndarray[Any, Any], ...]:
    x = np.asarray(curve.steps, dtype=float)
    y = np.asarray(curve.values, dtype=float)
    with np.errstate(invalid="ignore"):  # NaN compares False: dropped like the rest
        keep = (np.abs(x) < _PLOTTABLE) & (np.abs(y) < _PLOTTABLE)
        if log_y:
            keep &= (y > 1 / _PLOTTABLE_LOG) & (y < _PLOTTABLE_LOG)
    return x[keep], y[keep]


def _legend_layout(labels: Sequence[str], width: Width) -> tuple[int, float]:
    """Columns and height (inches) of a legend placed below the axes."""
    char_pt = 0.55 * float(_RC["legend.fontsize"])
    col_pt = max((len(t) for t in labels), default=1) * char_pt + 28  # + handle and padding
    ncols = max(1, min(4, int(WIDTHS[width] * 72 // col_pt)))
    rows = math.ceil(len(labels) / ncols)
    return ncols, rows * 1.35 * float(_RC["legend.fontsize"]) / 72 + 0.1


def curves(
    series: Sequence[Curve],
    *,
    metric: str,
    xlabel: str = "step",
    width: Width = "one",
    log_y: bool = False,
    title: str = "",
) -> Figure:
    """Overlaid curves of one metric, one Okabe–Ito colour each (line styles after eight)."""
    labels = [label(c.label) for c in series]
    below = len(series) > _LEGEND_INSIDE_MAX
    ncols, legend_h = _legend_layout(labels, width) if below else (1, 0.0)
    with _style():
        fig = _figure(width, extra_height=legend_h)
        ax = fig.add_subplot()
        handles: list[Line2D] = []
        for i, curve in enumerate(series):
            x, y = _finite_xy(curve, log_y=log_y)
            (line,) = ax.plot(
                x, y, color=OKABE_ITO[i % len(OKABE_ITO)],
                linestyle=_LINESTYLES[(i // len(OKABE_ITO)) % len(_LINESTYLES)],
                marker="o" if len(x) == 1 else "",  # a single point has no line to show
            )
            handles.append(line)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(label(xlabel), parse_math=False)
        ax.set_ylabel(label(metric), parse_math=False)
        if title:
            ax.set_title(label(title), parse_math=False)
        if len(series) > 1:
            legend = (
                fig.legend(handles, labels, loc="outside lower center", ncols=ncols)
                if below else ax.legend(handles, labels, loc="best")
            )
            for text in legend.get_texts():
                text.set_parse_math(False)
        return _frozen(fig)


# --- parallel coordinates -----------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: object) -> float | None:
    """The value as a finite float, or None (strings, bools, NaN, inf, missing)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        as_float = float(value)
        return as_float if math.isfinite(as_float) else None
    return None


#: Beyond this a colour scale's span overflows (matplotlib computes max − min and ticks
#: in floats): such values are left out like NaN.
_DRAWABLE: Final = 1e300


def _finite_metric(row: Row, metric: str) -> float | None:
    value = _finite(row.get(metric))
    return value if value is not None and abs(value) <= _DRAWABLE else None


@dataclass(frozen=True, slots=True)
class _Scale:
    """Where each value of one axis goes in [0, 1], and the ticks that say so."""

    positions: Mapping[object, float] | None  # categorical; None means numeric
    lo: float = 0.0
    hi: float = 1.0
    log: bool = False  # spread over decades (learning rates), so equal ratios look equal

    def place(self, value: object) -> float:
        if self.positions is not None:
            return self.positions.get(_category(value), math.nan)
        number = _finite(value)
        if number is None or (self.log and number <= 0):
            return math.nan  # a gap in the polyline
        lo, hi = (math.log10(self.lo), math.log10(self.hi)) if self.log else (self.lo, self.hi)
        at = math.log10(number) if self.log else number
        return 0.5 if hi == lo else (at - lo) / (hi - lo)

    def ticks(self) -> list[tuple[float, str]]:
        if self.positions is not None:
            return [(pos, label(name, MAX_TICK_LABEL)) for name, pos in self.positions.items()]
        if self.hi == self.lo:
            return [(0.5, _num(self.lo))]
        return [(0.0, _num(self.lo)), (1.0, _num(self.hi))]


def _category(value: object) -> str:
    return _num(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else str(value)


def _categories(values: Sequence[object]) -> list[str]:
    """Distinct names, numbers first in numeric order (1e-05 before 1), then text."""
    order: dict[str, tuple[int, float, str]] = {
        _category(v): (0, f, "") if (f := _finite(v)) is not None else (1, 0.0, str(v))
        for v in values
    }
    return sorted(order, key=order.__getitem__)


def _scale(values: Sequence[object]) -> _Scale:
    present = [v for v in values if v is not None]
    if all(_is_number(v) for v in present):
        finite = [f for v in present if (f := _finite(v)) is not None]
        lo, hi = min(finite, default=0.0), max(finite, default=0.0)
        return _Scale(None, lo, hi, log=lo > 0 and hi / lo >= _LOG_RATIO)
    names = _categories(present)
    step = 1 / (len(names) - 1) if len(names) > 1 else 0.0
    return _Scale({n: (i * step if len(names) > 1 else 0.5) for i, n in enumerate(names)})


def _draw_axis_ticks(ax: Axes, x: float, scale: _Scale) -> None:
    for y, text in scale.ticks():
        ax.text(x + 0.03, y, text, ha="left", va="center", fontsize=6, parse_math=False,
                clip_on=False)


def parallel_coordinates(
    rows: Sequence[Row], *, axes: Sequence[str], metric: str, width: Width = "two"
) -> Figure:
    """One polyline per run across the varied parameters and then the metric, coloured by it."""
    kept = sorted(
        ((m, r) for r in rows if (m := _finite_metric(r, metric)) is not None),
        key=lambda pair: pair[0],  # high values drawn last, on top
    )
    names = [*axes, metric]
    with _style():
        fig = _figure(width)
        ax = fig.add_subplot()
        if not kept:
            return _note(fig, ax, f"no finite values of {label(metric)}")
        scales = [_scale([r.get(n) for _, r in kept]) for n in names]
        pairs = list(zip(names, scales, strict=True))
        lines = [[(i, s.place(r.get(n))) for i, (n, s) in enumerate(pairs)]
                 for _, r in kept]
        metrics = np.array([m for m, _ in kept])
        norm = Normalize(vmin=float(metrics.min()), vmax=float(metrics.max()))
        coll = LineCollection(lines, array=metrics, cmap="viridis", norm=norm,
                              linewidths=0.8, alpha=0.8)
        ax.add_collection(coll)
        # Dots too: a value whose neighbours are missing has no line segment to show it.
        points = [(px, py, m) for (m, _), line in zip(kept, lines, strict=True)
                  for px, py in line if math.isfinite(py)]
        ax.scatter([p[0] for p in points], [p[1] for p in points], c=[p[2] for p in points],
                   cmap="viridis", norm=norm, s=4, linewidths=0, zorder=3)
        for i, scale in enumerate(scales):
            ax.axvline(i, color="#59636e", linewidth=0.6)
            _draw_axis_ticks(ax, i, scale)
        ax.set_xlim(-0.1, len(names) - 0.75)
        ax.set_ylim(-0.05, 1.05)
        _xticks(ax, [label(n, MAX_TICK_LABEL) for n in names], crowded=len(names) > 6)
        ax.set_yticks([])
        ax.grid(False)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        _colorbar(fig, ax, coll, metric)
        return _frozen(fig)


def _xticks(ax: Axes, labels: Sequence[str], *, crowded: bool) -> None:
    """Category names under the x axis; slanted, ending at their tick, when they would touch."""
    ax.set_xticks(range(len(labels)), labels, parse_math=False)
    if crowded:
        for text in ax.get_xticklabels():
            text.set(rotation=30, ha="right", rotation_mode="anchor")


def _colorbar(fig: Figure, ax: Axes, mappable: ScalarMappable, metric: str) -> Colorbar:
    cbar = fig.colorbar(mappable, ax=ax)
    cbar.set_label(label(metric), parse_math=False)
    if cbar.solids is not None:
        cbar.solids.set_rasterized(False)  # vector all the way: no <image> in the SVG
        cbar.solids.set_edgecolor("face")  # hides hairline seams between the colour steps
    cbar.outline.set_linewidth(0.4)
    return cbar


# --- heatmap ------------------------------------------------------------------------------


def _axis_keys(values: Sequence[object]) -> tuple[list[object], Callable[[object], object]]:
    """Distinct values in order (numeric when all are finite numbers, else by text), and the
    function that maps a raw value to its key."""
    if all(_finite(v) is not None for v in values):
        numbers: list[object] = [*sorted({f for v in values if (f := _finite(v)) is not None})]
        return numbers, _finite
    names: list[object] = [*_categories(values)]
    return names, _category


def _grid(rows: Sequence[Row], x: str, y: str, metric: str) -> tuple[
    list[object], list[object], np.ndarray[Any, Any]
]:
    """The mean of the finite metric values per (x, y) cell; NaN where there are none."""
    placed = [r for r in rows if r.get(x) is not None and r.get(y) is not None]
    xs, x_key = _axis_keys([r[x] for r in placed])
    ys, y_key = _axis_keys([r[y] for r in placed])
    xi = {v: i for i, v in enumerate(xs)}
    yi = {v: i for i, v in enumerate(ys)}
    total, count = np.zeros((len(ys), len(xs))), np.zeros((len(ys), len(xs)))
    for r in placed:
        m = _finite_metric(r, metric)
        if m is not None:
            i, j = yi[y_key(r[y])], xi[x_key(r[x])]
            total[i, j] += m
            count[i, j] += 1
    grid = np.full(total.shape, np.nan)
    np.divide(total, count, out=grid, where=count > 0)
    return xs, ys, grid


def _annotate(ax: Axes, grid: np.ndarray[Any, Any], mesh: ScalarMappable) -> None:
    for (i, j), value in np.ndenumerate(grid):
        if not math.isfinite(value):
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="////",
                                   edgecolor="#c8c8c8", linewidth=0))
            continue
        if grid.size > _MAX_ANNOTATED_CELLS:
            continue
        r, g, b, _ = mesh.to_rgba(value)
        dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
        ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=6,
                color="white" if dark else "black", parse_math=False)


def heatmap(
    rows: Sequence[Row], *, x: str, y: str, metric: str, width: Width = "one"
) -> Figure:
    """The metric over two varied parameters, each cell labelled; missing cells hatched."""
    xs, ys, grid = _grid(rows, x, y, metric)
    with _style():
        fig = _figure(width, ratio=0.8)
        ax = fig.add_subplot()
        if not np.isfinite(grid).any():
            return _note(fig, ax, f"no finite values of {label(metric)}")
        mesh = ax.pcolormesh(
            np.arange(len(xs) + 1) - 0.5, np.arange(len(ys) + 1) - 0.5,
            np.ma.masked_invalid(grid), cmap="cividis", shading="flat",
        )
        _annotate(ax, grid, mesh)
        x_labels = [label(_category(v), MAX_TICK_LABEL) for v in xs]
        _xticks(ax, x_labels, crowded=len(xs) > 6 or max(map(len, x_labels)) > 6)
        y_labels = [label(_category(v), MAX_TICK_LABEL) for v in ys]
        ax.set_yticks(range(len(ys)), y_labels, parse_math=False)
        ax.set_xlabel(label(x), parse_math=False)
        ax.set_ylabel(label(y), parse_math=False)
        ax.grid(False)
        ax.set_aspect("auto")
        _colorbar(fig, ax, mesh, metric)
        return _frozen(fig)


# --- output -------------------------------------------------------------------------------


def render(fig: Figure, fmt: Format) -> bytes:
    """The figure as bytes; SVG and PDF are identical for identical inputs in any process."""
    buf = io.BytesIO()
    with _style():
        if fmt == "svg":
            FigureCanvasSVG(fig).print_figure(buf, format="svg", metadata=_METADATA["svg"])
        elif fmt == "pdf":
            FigureCanvasPdf(fig).print_figure(buf, format="pdf", metadata=_METADATA["pdf"])
        elif fmt == "png":  # thumbnails only: raster, so not for papers
            FigureCanvasAgg(fig).print_figure(
                buf, format="png", dpi=PNG_DPI, metadata=_METADATA["png"]
            )
        else:
            raise ValueError(f"unknown figure format {fmt!r}")
    return buf.getvalue()


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    """A reader sees the old file or the new one, never half of one."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp_name, 0o644)  # figures are for people to open and share
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


def save(fig: Figure, path_stem: Path) -> list[Path]:
    """Write `<stem>.svg` (for HTML) and `<stem>.pdf` (for LaTeX); return their paths."""
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    formats: tuple[Format, ...] = ("svg", "pdf")
    for fmt in formats:
        path = path_stem.with_name(f"{path_stem.name}.{fmt}")
        _write_bytes_atomic(path, render(fig, fmt))
        paths.append(path)
    return paths
