"""Comparing runs (pure): which steps are compared, what varied between them, and the final
and best value of every metric — the table `m27 compare` prints, writes as CSV and JSON,
and draws.

Members: with one run, the members of its `matrix:` sweeps (every step with matrix values
and metrics), or every step with metrics when it has no sweep; with several runs, every
step with metrics of each. The *varied* parameters are the step's matrix values and, across
several runs, the runs' `--var` values, kept where they differ between members.

Best is the lowest value for a metric whose name says lower is better (loss, error,
perplexity, …: `LOWER_IS_BETTER`), else the highest; `goals` overrides it per metric, and
every output says which it used. Non-finite values are never best; a curve that ends in NaN
has a NaN final value, shown as such.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import msgspec

from m27.common.curves import Curve
from m27.common.model import RunRecord
from m27.report import efficiency

Goal = Literal["min", "max"]
LOWER_IS_BETTER: Final = re.compile(
    r"loss|err|perplex|ppl|mse|mae|rmse|nll|wer|cer|latency|regret|energy|time|_kl|^kl",
    re.IGNORECASE)


def goal_of(name: str, goals: Mapping[str, Goal]) -> Goal:
    """Which way is better for metric `name`."""
    if name in goals:
        return goals[name]
    return "min" if LOWER_IS_BETTER.search(name) else "max"


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """One compared step: where it comes from, what varied, and its curves by metric."""

    label: str
    run_id: str
    step: str
    state: str
    params: dict[str, str]
    curves: dict[str, Curve]
    energy_j: float | None = None  # its GPUs' energy (its share of it)
    gpu_simulated: bool = False  # that energy is modelled


class Value(msgspec.Struct, frozen=True, kw_only=True):
    """A metric of a member: its final value and its best finite one, each at its step."""

    final: float
    final_step: int
    best: float | None
    best_step: int | None


class Row(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    run_id: str
    step: str
    state: str
    params: dict[str, str]
    values: dict[str, Value]
    energy_j: float | None = None
    gpu_simulated: bool = False
    #: work per joule by unit (m27.report.efficiency); empty with energy: no work counter
    per_joule: dict[str, float] = msgspec.field(default_factory=dict)


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """The table: `params` (the varied ones, by name) and `metrics` are its columns; rows
    are sorted by the best value of `metrics[0]`, best first (members without it last)."""

    params: tuple[str, ...]
    metrics: tuple[str, ...]
    goals: dict[str, Goal]
    rows: tuple[Row, ...]
    #: the work units some member counted (`work.<unit>` metrics), when any has energy
    work_units: tuple[str, ...] = ()

    @property
    def energy(self) -> bool:
        """Some member has GPU energy: the energy and work-per-joule columns are shown."""
        return any(row.energy_j for row in self.rows)


def members_of(runs: Sequence[RunRecord], curves: Mapping[str, Sequence[Curve]]
               ) -> list[Member]:
    """The members to compare (module docstring): `curves` by run id."""
    out: list[Member] = []
    for run in runs:
        by_step: dict[str, dict[str, Curve]] = {}
        for curve in curves.get(run.run_id, ()):
            by_step.setdefault(curve.step, {})[curve.name] = curve
        steps = [s for s in run.steps if s.name in by_step]
        if len(runs) == 1 and any(s.matrix for s in steps):
            steps = [s for s in steps if s.matrix]
        for step in steps:
            params = dict(step.matrix)
            if len(runs) > 1:
                params = {**{f"var:{k}": v for k, v in run.vars.items()}, **params}
            label = step.name if len(runs) == 1 else (
                run.run_id if len(steps) == 1 else f"{run.run_id}/{step.name}")
            out.append(Member(label=label, run_id=run.run_id, step=step.name,
                              state=step.state, params=params, curves=by_step[step.name],
                              energy_j=step.energy_j, gpu_simulated=step.gpu_simulated))
    return out


def compare(members: Sequence[Member], *, metrics: Sequence[str] = (),
            goals: Mapping[str, Goal] = {}) -> Comparison:
    """The comparison of `members` on `metrics` (default: every metric any member has,
    "loss" first if there is one, then by name)."""
    names = list(dict.fromkeys(metrics)) or _default_metrics(members)
    keys = sorted({k for m in members for k in m.params})  # no order in a proto map
    varied = tuple(k for k in keys if len({m.params.get(k, "") for m in members}) > 1)
    used = {n: goal_of(n, goals) for n in names}
    rows = [Row(label=m.label, run_id=m.run_id, step=m.step, state=m.state,
                params={k: m.params.get(k, "") for k in varied},
                values={n: _value(m.curves[n], used[n]) for n in names if n in m.curves},
                energy_j=m.energy_j, gpu_simulated=m.gpu_simulated,
                per_joule={e.unit: e.per_joule for e in efficiency.efficiencies(
                    efficiency.work_counters(m.curves.values()), m.energy_j)})
            for m in members]
    if names:
        rows.sort(key=lambda r: _rank(r, names[0], used[names[0]]))
    units = tuple(sorted({u for r in rows for u in r.per_joule}))
    return Comparison(params=varied, metrics=tuple(names), goals=used, rows=tuple(rows),
                      work_units=units)


def _default_metrics(members: Sequence[Member]) -> list[str]:
    names = sorted({n for m in members for n in m.curves})
    return sorted(names, key=lambda n: (n != "loss", n))


def _value(curve: Curve, goal: Goal) -> Value:
    best = curve.best(goal)
    return Value(final=curve.last, final_step=curve.last_step,
                 best=None if best is None else best[0],
                 best_step=None if best is None else best[1])


def _rank(row: Row, metric: str, goal: Goal) -> tuple[bool, float, str]:
    value = row.values.get(metric)
    if value is None or value.best is None:
        return (True, 0.0, row.label)
    return (False, value.best if goal == "min" else -value.best, row.label)


def number(value: float | None) -> str:
    """A value as the table shows it: 4 significant digits, NaN and ±inf spelled out."""
    if value is None:
        return ""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def header(comparison: Comparison) -> list[str]:
    """Column names: member, state, the varied parameters, then final and best of each
    metric (the best's goal in brackets)."""
    cols = ["member", "state", *comparison.params]
    for name in comparison.metrics:
        cols += [f"{name} final", f"{name} best ({comparison.goals[name]})"]
    if comparison.energy:
        cols += ["GPU energy (J)", *(f"{efficiency.unit_label(u)}/J"
                                     for u in comparison.work_units or ("work",))]
    return cols


def cells(comparison: Comparison) -> list[list[str]]:
    """The table's rows as text, in `header` order."""
    out = []
    for row in comparison.rows:
        line = [row.label, row.state, *(row.params[k] for k in comparison.params)]
        for name in comparison.metrics:
            v = row.values.get(name)
            line += ["", ""] if v is None else [number(v.final), number(v.best)]
        if comparison.energy:
            line += _energy_cells(row, comparison.work_units)
        out.append(line)
    return out


def _energy_cells(row: Row, units: Sequence[str]) -> list[str]:
    """Energy (marked when modelled), then work per joule by unit; a member with energy
    and no counter says so rather than leave it to be guessed."""
    if not row.energy_j:
        return ["", *("" for _ in units or ("work",))]
    energy = number(row.energy_j) + (" (simulated)" if row.gpu_simulated else "")
    if not row.per_joule:
        return [energy, efficiency.NO_COUNTER, *("" for _ in units[1:])]
    return [energy, *(number(row.per_joule[u]) if u in row.per_joule else ""
                      for u in units)]


def to_csv(comparison: Comparison) -> str:
    """CSV for spreadsheets and scripts: full precision (repr), empty when absent."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)  # RFC 4180: CRLF, so a CR inside a value is quoted
    cols = ["member", "run_id", "step", "state", *comparison.params]
    for name in comparison.metrics:
        cols += [f"{name}_final", f"{name}_final_step", f"{name}_best", f"{name}_best_step"]
    if comparison.energy:  # the GPU energy, and work per joule of it (efficiency)
        cols += ["gpu_energy_j", "gpu_energy_simulated",
                 *(f"work_{u}_per_j" for u in comparison.work_units)]
    writer.writerow(cols)
    for row in comparison.rows:
        line = [row.label, row.run_id, row.step, row.state,
                *(row.params[k] for k in comparison.params)]
        for name in comparison.metrics:
            v = row.values.get(name)
            line += ["", "", "", ""] if v is None else [
                repr(v.final), str(v.final_step), "" if v.best is None else repr(v.best),
                "" if v.best_step is None else str(v.best_step)]
        if comparison.energy:
            line += ["" if row.energy_j is None else repr(row.energy_j),
                     str(row.gpu_simulated).lower() if row.energy_j else "",
                     *(repr(row.per_joule[u]) if u in row.per_joule else ""
                       for u in comparison.work_units)]
        writer.writerow([_csv_safe(c) for c in line])
    return buffer.getvalue()


def _csv_safe(text: str) -> str:
    """A spreadsheet runs a cell that starts with = + - @ as a formula: quote it with '
    unless it is a number."""
    if text[:1] in ("=", "+", "-", "@", "\t", "\r"):
        try:
            float(text)
        except ValueError:
            return "'" + text
    return text


def to_json(comparison: Comparison) -> bytes:
    """JSON for scripts: the comparison as it is, non-finite values as null plus a
    `…_text` spelling (JSON has no NaN)."""
    rows = []
    for row in comparison.rows:
        values = {}
        for name, v in row.values.items():
            values[name] = {"final": _finite(v.final), "final_text": number(v.final),
                            "final_step": v.final_step, "best": v.best,
                            "best_step": v.best_step}
        rows.append({"member": row.label, "run_id": row.run_id, "step": row.step,
                     "state": row.state, "params": row.params, "metrics": values,
                     "gpu_energy_j": row.energy_j, "gpu_energy_simulated": row.gpu_simulated,
                     "work_per_joule": row.per_joule,
                     "work_note": efficiency.NO_COUNTER
                     if row.energy_j and not row.per_joule else ""})
    return msgspec.json.encode({"params": comparison.params, "metrics": comparison.metrics,
                                "goals": comparison.goals, "work_units": comparison.work_units,
                                "rows": rows})


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def numeric(values: Sequence[str]) -> bool:
    """Every one of `values` reads as a finite number (an axis to scale, not to list)."""
    try:
        return all(math.isfinite(float(v)) for v in values)
    except ValueError:
        return False
