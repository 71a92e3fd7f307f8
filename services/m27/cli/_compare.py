"""`m27 compare RUN [RUN…]`: runs (or the members of one run's `matrix:` sweep) side by
side — the varied values against the final and best value of every metric — as a table,
CSV, JSON or one HTML page, and with `-o DIR` the figures as SVG and PDF.

The runs come from the orchestrator's API (`GetRun`: steps, states, matrix values), their
curves from the report service's (`m27.v1.ReportService`: `--report HOST:PORT`,
`$M27_REPORT`, else the embedded system's report process). What is compared and how best is
chosen: `m27.report.compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from m27.cli._common import Subparsers, add, api_address, config, service_address
from m27.cli._live import console, table
from m27.client import Client
from m27.client.report import ReportClient
from m27.common.curves import Curve
from m27.common.errors import M27Error
from m27.common.ids import is_valid_run_id
from m27.common.model import RunRecord
from m27.report.compare import (
    Comparison,
    Goal,
    Member,
    cells,
    compare,
    header,
    members_of,
    to_csv,
    to_json,
)
from m27.report.efficiency import WORK_PREFIX
from m27.report.files import write_atomic

REPORT_ENV: Final = "M27_REPORT"
MAX_RUNS: Final = 200
FORMATS: Final = ("table", "csv", "json", "html")


def add_commands(sub: Subparsers) -> None:
    parser = add(sub, "compare", "compare runs, or the members of one run's matrix: sweep: "
                 "the values that varied against the final and best value of each metric "
                 "(a table, CSV, JSON or an HTML page; -o DIR also writes the figures as SVG "
                 "and PDF)", cmd_compare)
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run ids; one run compares the members of its matrix: sweep "
                        "(or its steps that logged metrics)")
    parser.add_argument("--metric", action="append", default=[], metavar="NAME",
                        help="compare on these metrics only, the first one sorting the table "
                        "(repeat it; default: every metric, loss first)")
    parser.add_argument("--goal", action="append", default=[], metavar="NAME=min|max",
                        help="which way is better for a metric (default: min for names with "
                        "loss, err, perplexity, mse, …; max otherwise)")
    parser.add_argument("--format", choices=FORMATS, default="table",
                        help="what to print (default: table); -o DIR writes every format")
    parser.add_argument("-o", "--out", metavar="DIR", type=Path,
                        help="write compare.csv, compare.json, compare.html and the figures "
                        "(curves, parallel coordinates, heat map) as SVG and PDF into DIR")
    parser.add_argument("--width", choices=("one", "two"), default="one",
                        help="figure size: one column (3.5 in) or two (7.2 in) of a paper")
    parser.add_argument("--points", type=int, default=2000, metavar="N",
                        help="at most N points per curve in the figures (default 2000; "
                        "finals and bests always use every point)")
    parser.add_argument("--report", metavar="HOST:PORT",
                        help=f"report service address (default: ${REPORT_ENV}, or the "
                        "embedded system's)")


def parse_goals(items: Sequence[str]) -> dict[str, Goal]:
    goals: dict[str, Goal] = {}
    for item in items:
        name, _, goal = item.partition("=")
        if not name or goal not in ("min", "max"):
            raise M27Error(f"--goal {item[:100]!r}: write NAME=min or NAME=max")
        goals[name] = "min" if goal == "min" else "max"
    return goals


def check_runs(runs: Sequence[str]) -> list[str]:
    """The run ids, each once, in the order given; a clear error for anything else."""
    ids = list(dict.fromkeys(runs))
    if len(ids) > MAX_RUNS:
        raise M27Error(f"at most {MAX_RUNS} runs at once ({len(ids)} given)")
    for run_id in ids:
        if not is_valid_run_id(run_id):
            raise M27Error(f"not a run id: {run_id[:80]!r} (run ids look like "
                           "r-20261201-081500-a1b2c3; `m27 runs` lists them)")
    return ids


async def fetch(api: str, report: str, run_ids: Sequence[str], names: Sequence[str],
                points: int) -> tuple[list[RunRecord], dict[str, list[Curve]]]:
    """Each run's record and curves (only `names` when given, plus the work counters, whose
    totals give work per joule: m27.report.efficiency)."""
    async with Client(api) as client, ReportClient(report) as history:
        runs = [await client.get_run(r) for r in run_ids]
        curves = {r: await history.metrics(r, names=names, max_points=points)
                  for r in run_ids}
        if names:
            for run_id in run_ids:  # a counter's total is its summary: 2 points are enough
                curves[run_id] += [c for c in await history.metrics(run_id, max_points=2)
                                   if c.name.startswith(WORK_PREFIX) and c.name not in names]
    return runs, curves


def cmd_compare(args: argparse.Namespace) -> int:
    run_ids = check_runs(args.runs)
    goals = parse_goals(args.goal)
    if not 2 <= args.points <= 10_000:
        raise M27Error("--points: between 2 and 10000")
    report = service_address(args.report, os.environ, args.home, variable=REPORT_ENV,
                             process="report", flag="--report")
    runs, curves = asyncio.run(fetch(api_address(args, config(args)), report, run_ids,
                                     args.metric, args.points))
    notes = [f"{r.run_id}: no metrics logged (m27.train.log or $M27_METRICS_FILE)"
             for r in runs if not curves[r.run_id]]
    members = members_of(runs, curves)
    if not members:
        raise M27Error("nothing to compare: " + "; ".join(notes or ["no metrics"]))
    comparison = compare(members, metrics=args.metric, goals=goals)
    missing = [n for n in args.metric if not any(n in m.curves for m in members)]
    notes += [f"no member logged the metric {n!r}" for n in missing]
    title = ", ".join(run_ids) if len(run_ids) <= 4 else f"{len(run_ids)} runs"
    if args.out is not None:
        for path in write_all(args.out, comparison, members, title=title, notes=notes,
                              width=args.width):
            print(f"wrote {path}", file=sys.stderr)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    emit(args.format, comparison, members, title=title, notes=notes, width=args.width)
    return 0


def emit(fmt: str, comparison: Comparison, members: Sequence[Member], *, title: str,
         notes: Sequence[str], width: str) -> None:
    if fmt == "csv":
        sys.stdout.write(to_csv(comparison))
    elif fmt == "json":
        sys.stdout.write(to_json(comparison).decode() + "\n")
    elif fmt == "html":
        from m27.report import compare_page  # matplotlib: only when drawing
        drawn = compare_page.draw(comparison, members, width="two" if width == "two" else "one")
        sys.stdout.write(compare_page.page(comparison, drawn, title=title, notes=notes,
                                           generated=_now()))
    elif sys.stdout.isatty():
        console(sys.stdout).print(table(header(comparison), cells(comparison),
                                        right=header(comparison)[2:], squeeze=("member",)))
    else:
        print("\t".join(header(comparison)))
        for row in cells(comparison):
            print("\t".join(row))


def write_all(out: Path, comparison: Comparison, members: Sequence[Member], *, title: str,
              notes: Sequence[str], width: str) -> list[Path]:
    """Every format and figure into `out` (created if needed); the paths written."""
    from m27.plots import figures  # matplotlib: only when drawing
    from m27.report import compare_page
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise M27Error(f"cannot create {out}: {exc.strerror or exc}") from None
    drawn = compare_page.draw(comparison, members, width="two" if width == "two" else "one")
    written = []
    for name, text in (("compare.csv", to_csv(comparison)),
                       ("compare.json", to_json(comparison).decode() + "\n"),
                       ("compare.html", compare_page.page(comparison, drawn, title=title,
                                                          notes=notes, generated=_now()))):
        write_atomic(out / name, text)
        written.append(out / name)
    for figure in drawn:
        written += figures.save(figure.figure, out / figure.stem)
    return written


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
