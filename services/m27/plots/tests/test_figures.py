"""Figures: reproducible bytes, literal user labels, and no crash on odd data."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from m27.plots.figures import (
    MAX_LABEL,
    MAX_TICK_LABEL,
    OKABE_ITO,
    Curve,
    Format,
    curves,
    heatmap,
    label,
    parallel_coordinates,
    render,
    save,
)

_SVG_NS = "{http://www.w3.org/2000/svg}"

ROWS: list[Mapping[str, float | str]] = [
    {"lr": 1e-4, "opt": "adam", "bs": 32, "acc": 0.71},
    {"lr": 1e-3, "opt": "adam", "bs": 64, "acc": 0.80},
    {"lr": 1e-2, "opt": "sgd", "bs": 32, "acc": 0.62},
    {"lr": 1e-3, "opt": "sgd", "bs": 128, "acc": 0.55},
    {"lr": 1e-2, "opt": "lion", "bs": 64, "acc": float("nan")},  # left out
    {"lr": "auto", "opt": "adam", "acc": 0.77},  # a string on a numeric axis; bs missing
]


def sample_figures() -> dict[str, Figure]:
    """One figure of each kind; the subprocess test builds the same ones."""
    losses = [
        Curve(f"run-{i}", list(range(30)), [math.exp(-s / (5 + i)) for s in range(30)])
        for i in range(3)
    ]
    return {
        "curves": curves(losses, metric="val/loss", log_y=True, title="loss"),
        "parallel": parallel_coordinates(ROWS, axes=["lr", "opt", "bs"], metric="acc"),
        "heatmap": heatmap(ROWS, x="lr", y="opt", metric="acc"),
    }


def digests() -> dict[str, str]:
    """sha256 of each sample in SVG and PDF."""
    return {
        f"{name}.{fmt}": hashlib.sha256(render(fig, fmt)).hexdigest()
        for name, fig in sample_figures().items()
        for fmt in ("svg", "pdf")
    }


@pytest.fixture(scope="module")
def samples() -> dict[str, Figure]:
    """Built once for the tests that only render them (rendering leaves a figure as it was)."""
    return sample_figures()


def _svg_texts(svg: bytes) -> list[str]:
    root = ET.fromstring(svg)  # noqa: S314 -- our own output, and parsing proves it is valid XML
    return ["".join(el.itertext()) for el in root.iter(f"{_SVG_NS}text")]


def _all_texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text)]


# --- reproducibility ----------------------------------------------------------------------


def test_same_figure_and_rebuilt_figure_give_the_same_bytes() -> None:
    """Rendering twice (the layout is fixed when built) and building twice change nothing."""
    first, second = sample_figures(), sample_figures()
    formats: tuple[Format, ...] = ("svg", "pdf")
    for name, fmt in itertools.product(first, formats):
        once = render(first[name], fmt)
        assert render(first[name], fmt) == once, (name, fmt)
        assert render(second[name], fmt) == once, (name, fmt)


@pytest.fixture(scope="module")
def expected_digests() -> dict[str, str]:
    return digests()


def test_bytes_do_not_depend_on_the_callers_rc_params(expected_digests: dict[str, str]) -> None:
    with matplotlib.rc_context({"font.size": 20, "lines.linewidth": 4, "axes.grid": False,
                                "svg.hashsalt": None, "pdf.fonttype": 3}):
        assert digests() == expected_digests


def test_bytes_are_the_same_in_other_processes_and_hash_seeds(
    expected_digests: dict[str, str],
) -> None:
    """Other hash seeds (set order) and MPLBACKEND values change nothing."""
    script = "import json; from m27.plots.tests.test_figures import digests; "
    script += "print(json.dumps(digests()))"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed, "MPLBACKEND": backend})
        for seed, backend in (("1", "agg"), ("4242", "pdf"))
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert [json.loads(out) for out in outputs] == [expected_digests, expected_digests]


# --- what is in the files -----------------------------------------------------------------


def test_svg_is_vector_with_searchable_text() -> None:
    fig = curves([Curve("alpha-run", [0, 1, 2], [3, 2, 1]), Curve("beta-run", [0, 1], [1, 2])],
                 metric="val/loss")
    svg = render(fig, "svg")
    texts = _svg_texts(svg)
    assert {"val/loss", "alpha-run", "beta-run", "step"} <= set(texts)
    assert b"<image" not in svg


@pytest.mark.parametrize("kind", ["parallel", "heatmap"])
def test_colorbars_stay_vector(kind: str, samples: dict[str, Figure]) -> None:
    svg = render(samples[kind], "svg")
    assert b"<image" not in svg
    assert "acc" in _svg_texts(svg)


def test_pdf_has_no_dates_and_embeds_truetype(samples: dict[str, Figure]) -> None:
    pdf = render(samples["curves"], "pdf")
    assert pdf.startswith(b"%PDF")
    assert b"CreationDate" not in pdf
    assert b"ModDate" not in pdf
    assert b"/FontFile2" in pdf  # fonttype 42: TrueType, so the text stays editable


def test_png_is_a_png(samples: dict[str, Figure]) -> None:
    assert render(samples["heatmap"], "png").startswith(b"\x89PNG\r\n\x1a\n")


def test_unknown_format_is_refused(samples: dict[str, Figure]) -> None:
    with pytest.raises(ValueError, match="format"):
        render(samples["curves"], "gif")  # type: ignore[arg-type]


def test_save_writes_svg_and_pdf_atomically(
    tmp_path: Path, samples: dict[str, Figure]
) -> None:
    fig = samples["heatmap"]
    paths = save(fig, tmp_path / "out" / "loss.v2")
    assert paths == [tmp_path / "out" / "loss.v2.svg", tmp_path / "out" / "loss.v2.pdf"]
    assert paths[0].read_bytes() == render(fig, "svg")
    assert paths[1].read_bytes() == render(fig, "pdf")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["loss.v2.pdf", "loss.v2.svg"]


# --- labels -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "drawn"),
    [
        ("loss", "loss"),
        ("a\nb\tc", "a b c"),
        ("nul\x00bell\x07esc\x1b", "nulbellesc"),
        ("rtl\u202eevil", "rtlevil"),
        ("x" * MAX_LABEL, "x" * MAX_LABEL),
        ("x" * (MAX_LABEL + 1), "x" * (MAX_LABEL - 1) + "…"),
        ("lone\ud800surrogate", "lonesurrogate"),
    ],
)
def test_label_is_one_safe_short_line(raw: str, drawn: str) -> None:
    assert label(raw) == drawn


HOSTILE = [
    r"$\frac{1}{0}$",
    "loss$x^2$",
    "_hidden",
    "<script>alert(1)</script>",
    "a & b ]]> \"q\" 'q'",
    "λ→∞ 日本語 🙂 ü",
    "$",
    "\\",
    "y" * 500,
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_labels_are_drawn_literally(hostile: str) -> None:
    fig = curves([Curve(hostile, [0, 1], [1, 2]), Curve("other", [0, 1], [2, 1])],
                 metric=hostile, xlabel=hostile, title=hostile)
    svg = render(fig, "svg")
    texts = _svg_texts(svg)
    assert texts.count(label(hostile)) == 4  # title, x label, y label, legend: not mathtext
    assert b"<script" not in svg


def test_hostile_labels_render_in_pdf() -> None:
    fig = curves([Curve(h, [0, 1], [i, 2]) for i, h in enumerate(HOSTILE)],
                 metric=HOSTILE[0], xlabel=HOSTILE[1], title=HOSTILE[3])
    assert render(fig, "pdf").startswith(b"%PDF")


def test_hostile_parameter_names_and_values_are_drawn_literally() -> None:
    rows: list[Mapping[str, float | str]] = [
        {**{h: h for h in HOSTILE}, "p": h, "m": 0.5 + i} for i, h in enumerate(HOSTILE)
    ]
    parallel = _svg_texts(render(parallel_coordinates(rows, axes=HOSTILE, metric="m"), "svg"))
    grid = _svg_texts(render(heatmap(rows, x="p", y=HOSTILE[0], metric="m"), "svg"))
    for hostile in HOSTILE:
        assert label(hostile, MAX_TICK_LABEL) in parallel  # the axis name and the value
        assert label(hostile, MAX_TICK_LABEL) in grid
    assert label(HOSTILE[0]) in grid


# --- curves -------------------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("series", "log_y"),
    [
        ([], False),
        ([Curve("empty", [], [])], False),
        ([Curve("one point", [3], [0.5])], False),
        ([Curve("non-finite", [0, 1, 2, 3, NAN], [1, NAN, INF, -INF, 2])], False),
        ([Curve("all nan", [0, 1], [NAN, NAN])], True),
        ([Curve("non-positive on log", [0, 1, 2], [0, -1, 1])], True),
        ([Curve("huge", [0, 1, 2], [1e308, -1e308, 5e-324])], False),
        ([Curve("flat", [0, 1], [2, 2])], True),
        ([Curve(f"run {i}", [0, 1, 2], [i, i + 1, i * 2]) for i in range(20)], False),
    ],
)
def test_awkward_series_render(series: list[Curve], log_y: bool) -> None:
    fig = curves(series, metric="m", log_y=log_y)
    assert b"<svg" in render(fig, "svg")
    assert render(fig, "pdf").startswith(b"%PDF")


def test_non_finite_points_are_left_out_of_the_line() -> None:
    fig = curves([Curve("c", [0, 1, 2, 3], [1, NAN, INF, 4])], metric="m")
    (line,) = fig.axes[0].get_lines()
    assert np.asarray(line.get_xdata()).tolist() == [0, 3]
    assert np.asarray(line.get_ydata()).tolist() == [1, 4]


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 steps but 3 values"):
        Curve("c", [0, 1], [1, 2, 3])


@pytest.mark.parametrize(
    ("n", "legend"),
    [(1, "none"), (2, "axes"), (6, "axes"), (7, "figure"), (20, "figure")],
)
def test_legend_only_for_several_curves_and_below_when_many(n: int, legend: str) -> None:
    fig = curves([Curve(f"c{i}", [0, 1], [0, i]) for i in range(n)], metric="m")
    ax = fig.axes[0]
    assert (ax.get_legend() is not None) == (legend == "axes")
    assert bool(fig.legends) == (legend == "figure")


def test_colours_are_okabe_ito_then_line_styles_tell_lines_apart() -> None:
    fig = curves([Curve(f"c{i}", [0, 1], [0, i]) for i in range(17)], metric="m")
    lines = fig.axes[0].get_lines()
    styles = {(str(ln.get_color()).lower(), ln.get_linestyle()) for ln in lines}
    assert len(styles) == 17
    assert [str(ln.get_color()).lower() for ln in lines[:8]] == [c.lower() for c in OKABE_ITO]
    assert lines[8].get_color() == lines[0].get_color()
    assert lines[8].get_linestyle() != lines[0].get_linestyle()


@pytest.mark.parametrize(("width", "inches"), [("one", 3.5), ("two", 7.16)])
def test_column_widths(width: str, inches: float) -> None:
    fig = curves([Curve("c", [0, 1], [0, 1])], metric="m", width=width)  # type: ignore[arg-type]
    w, h = fig.get_size_inches()
    assert w == pytest.approx(inches)
    assert 0.5 * w <= h <= 0.8 * w


# --- parallel coordinates -----------------------------------------------------------------


def test_parallel_coordinates_mixes_numeric_and_categorical_axes() -> None:
    fig = parallel_coordinates(ROWS, axes=["lr", "opt", "bs"], metric="acc")
    ax = fig.axes[0]
    (coll,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(coll.get_segments()) == 5  # the NaN-metric row is left out
    texts = _all_texts(fig)
    # "lr" holds a string, so it is categorical: numbers first in numeric order, then text.
    lr_ticks = [t for t in texts if t in {"0.0001", "0.001", "0.01", "auto"}]
    assert lr_ticks == ["0.0001", "0.001", "0.01", "auto"]
    assert "lion" not in texts  # only seen in the left-out row
    assert {"32", "128", "0.55", "0.8"} <= set(texts)  # numeric axes show real min and max
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lr", "opt", "bs", "acc"]
    assert fig.axes[1].get_ylabel() == "acc"  # the colorbar


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [{"a": 1.0, "m": NAN}, {"a": 2.0, "m": INF}, {"a": 3.0}, {"a": 4.0, "m": "n/a"}],
    ],
)
def test_parallel_coordinates_without_finite_metric_says_so(
    rows: Sequence[Mapping[str, float | str]],
) -> None:
    fig = parallel_coordinates(rows, axes=["a"], metric="m")
    assert "no finite values of m" in _all_texts(fig)
    render(fig, "svg")


def test_parallel_coordinates_single_row_and_constant_axes() -> None:
    fig = parallel_coordinates([{"a": 1.0, "b": "x", "m": 2.0}], axes=["a", "b"], metric="m")
    assert {"1", "x", "2"} <= set(_all_texts(fig))
    render(fig, "svg")


# --- heatmap ------------------------------------------------------------------------------


def test_heatmap_sorts_numbers_numerically_and_hatches_missing_cells() -> None:
    rows: list[Mapping[str, float | str]] = [
        {"bs": 10, "lr": 0.1, "loss": 0.123456},
        {"bs": 2, "lr": 0.1, "loss": 1.0},
        {"bs": 10, "lr": 0.01, "loss": 3.0},
        {"bs": 10, "lr": 0.01, "loss": 5.0},  # a second seed: the cell shows the mean
        {"bs": 2, "lr": 0.01, "loss": NAN},  # the missing cell
    ]
    fig = heatmap(rows, x="bs", y="lr", metric="loss")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "10"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.01", "0.1"]
    hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert len(hatched) == 1
    assert hatched[0].get_xy() == (-0.5, -0.5)
    assert {"0.123", "1", "4"} <= set(_all_texts(fig))
    assert fig.axes[1].get_ylabel() == "loss"
    assert b"<image" not in render(fig, "svg")


def test_heatmap_with_text_values_sorts_as_text() -> None:
    rows: list[Mapping[str, float | str]] = [
        {"opt": "sgd", "seed": 1, "m": 1.0}, {"opt": "adam", "seed": 1, "m": 2.0},
    ]
    fig = heatmap(rows, x="opt", y="seed", metric="m")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["adam", "sgd"]


def test_heatmap_without_finite_metric_says_so() -> None:
    fig = heatmap([{"a": 1, "b": 2, "m": NAN}], x="a", y="b", metric="m")
    assert "no finite values of m" in _all_texts(fig)
    render(fig, "pdf")


# --- properties ---------------------------------------------------------------------------

_floats = st.floats(allow_nan=True, allow_infinity=True)
_curve = st.integers(0, 12).flatmap(
    lambda n: st.builds(Curve, st.text(max_size=80), st.lists(_floats, min_size=n, max_size=n),
                        st.lists(_floats, min_size=n, max_size=n))
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(series=st.lists(_curve, max_size=9), metric=st.text(max_size=80), log_y=st.booleans())
def test_random_curves_always_render_valid_svg(
    series: list[Curve], metric: str, log_y: bool
) -> None:
    svg = render(curves(series, metric=metric, log_y=log_y), "svg")
    texts = _svg_texts(svg)  # parses: valid XML whatever the labels held
    if label(metric).strip():
        assert label(metric).strip() in " ".join(texts)


_value = st.one_of(_floats, st.integers(-(10**6), 10**6), st.text(max_size=12))
_row = st.fixed_dictionaries({}, optional={"a": _value, "b": _value, "m": _value})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_row, max_size=8))
def test_random_rows_always_render(rows: list[dict[str, float | str]]) -> None:
    for fig in (parallel_coordinates(rows, axes=["a", "b"], metric="m"),
                heatmap(rows, x="a", y="b", metric="m")):
        _svg_texts(render(fig, "svg"))
