"""`m27 watch`: follow a run live. Rendering is pure; the loop only feeds it events.

On a terminal the step table is a rich table redrawn in place (elapsed times ticking, cut to
the terminal's width); otherwise one line is printed per event, which suits logs and CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Final, TextIO

from msgspec.structs import replace
from rich.console import Group
from rich.text import Text

from m27.cli._live import LiveView, table
from m27.client import Client, ClientError, RunEvent
from m27.common.model import TERMINAL_RUN_STATES, RunRecord, StepRecord, StepState
from m27.common.units import format_duration

SYMBOLS: Final[dict[str, str]] = {
    "pending": "·", "queued": "…", "running": "▶", "succeeded": "✔", "failed": "✘",
    "cancelled": "■", "skipped": "↷", "retrying": "↻",
}
EXIT_CODES: Final[dict[str, int]] = {"succeeded": 0, "failed": 1, "cancelled": 3}
RECONNECTS: Final = 5


def apply_event(run: RunRecord, event: RunEvent) -> RunRecord:
    """The run view after `event` (a watcher's local copy; the server's record is truth)."""
    if event.type == "run_state_changed" and event.state:
        ended = event.at if event.state in TERMINAL_RUN_STATES else run.ended_at
        started = run.started_at or (event.at if event.state == "running" else None)
        return replace(run, state=event.state, ended_at=ended, started_at=started,
                       reason=event.reason or run.reason)
    if event.type == "step_state_changed":
        steps = tuple(_step_after(s, event) if s.name == event.step else s for s in run.steps)
        return replace(run, steps=steps)
    return run


def _step_after(step: StepRecord, event: RunEvent) -> StepRecord:
    state: StepState = event.state  # type: ignore[assignment]
    started = step.started_at or (event.at if state == "running" else None)
    ended = event.at if state in {"succeeded", "failed", "cancelled", "skipped"} else None
    return replace(step, state=state, attempt=event.attempt or step.attempt,
                   node_id=event.node_id or step.node_id, started_at=started, ended_at=ended,
                   exit_code=event.exit_code if event.exit_code is not None
                   else step.exit_code, reason=event.reason or step.reason)


def header(run: RunRecord, now: float) -> str:
    done = sum(s.state == "succeeded" for s in run.steps)
    took = format_duration(_elapsed(run.started_at or run.created_at, run.ended_at, now))
    return (f"run {run.run_id}  {run.name}  {run.state}  {done}/{len(run.steps)} steps "
            f"done  {took}")


def step_rows(run: RunRecord, now: float) -> list[tuple[str, str, str, str, str, str]]:
    """One row per step: symbol, name, state, elapsed, node, what went wrong."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    for step in run.steps:
        elapsed = (format_duration(_elapsed(step.started_at, step.ended_at, now))
                   if step.started_at else "")
        extra = f"exit {step.exit_code}" if step.exit_code not in (None, 0) else ""
        rows.append((SYMBOLS.get(step.state, "?"), step.name, step.state, elapsed,
                     step.node_id or "", extra))
    return rows


def render_table(run: RunRecord, now: float) -> list[str]:
    """The progress view as plain lines (output that is not a terminal)."""
    width = max((len(s.name) for s in run.steps), default=4)
    return [header(run, now)] + [
        f"  {symbol} {name:<{width}}  {state:<9}  {elapsed:>7}  {where}  {extra}".rstrip()
        for symbol, name, state, elapsed, where, extra in step_rows(run, now)]


def render_frame(run: RunRecord, now: float) -> Group:
    """The progress view on a terminal: the header and a rich table of the steps."""
    steps = table(("", "step", "state", "time", "node", "note"), step_rows(run, now),
                  right=("time",), squeeze=("node", "note"))
    return Group(Text(header(run, now), no_wrap=True, overflow="ellipsis"), steps)


def _elapsed(start: float | None, end: float | None, now: float) -> float:
    if start is None:
        return 0.0
    return max(0.0, (end or now) - start)


def render_event_line(event: RunEvent) -> str | None:
    """One log line per event for non-terminal output."""
    stamp = time.strftime("%H:%M:%S", time.localtime(event.at))
    if event.type == "step_state_changed":
        where = f" on {event.node_id}" if event.node_id and event.state == "running" else ""
        code = f" (exit {event.exit_code})" if event.exit_code not in (None, 0) else ""
        why = f": {event.reason}" if event.reason and event.state != "succeeded" else ""
        return f"{stamp} step {event.step}: {event.previous} → {event.state}{where}{code}{why}"
    if event.type == "run_state_changed":
        why = f": {event.reason}" if event.reason else ""
        return f"{stamp} run {event.run_id}: {event.state}{why}"
    return None


async def watch(client: Client, run_id: str, out: TextIO = sys.stdout,
                live: bool | None = None) -> RunRecord:
    """Follow the run until it ends (reconnecting after a dropped connection without
    missing an event); returns its last view."""
    view = _View(out, out.isatty() if live is None else live)
    try:
        for attempt in range(RECONNECTS + 1):
            try:
                async for item in client.watch(run_id, after_sequence=view.sequence):
                    view.show(item)
                break
            except ClientError:
                if view.run is None or attempt == RECONNECTS:
                    raise
                await asyncio.sleep(min(5.0, 0.5 * 2 ** attempt))
    finally:
        await view.close()
    return await client.get_run(run_id)


class _View:
    """What the watcher has seen, drawn as a live table or as event lines."""

    def __init__(self, out: TextIO, interactive: bool) -> None:
        self.out = out
        self.interactive = interactive
        self.screen = LiveView(out, interactive)
        self.run: RunRecord | None = None
        self.sequence = 0
        self.ticker: asyncio.Task[None] | None = None

    def show(self, item: RunRecord | RunEvent) -> None:
        if isinstance(item, RunRecord):
            self.run = item
            if not self.interactive:
                print("\n".join(render_table(item, time.time())), file=self.out, flush=True)
            elif self.ticker is None:
                self.ticker = asyncio.create_task(self._tick())
        elif self.run is not None:
            self.sequence = max(self.sequence, item.sequence)
            self.run = apply_event(self.run, item)
            line = None if self.interactive else render_event_line(item)
            if line:
                print(line, file=self.out, flush=True)
        if self.interactive and self.run is not None:
            self.screen.draw(render_frame(self.run, time.time()))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.run is not None:
                self.screen.draw(render_frame(self.run, time.time()))

    async def close(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.ticker
        self.screen.close()


TAIL_LINES: Final = 10


def stderr_tail(step: StepRecord) -> list[str]:
    """The last `TAIL_LINES` lines of a step's stderr (`m27 show`, a watch's outcome)."""
    return step.stderr_tail.rstrip().splitlines()[-TAIL_LINES:]


def outcome_lines(run: RunRecord, report_path: str = "") -> list[str]:
    """How a watched run ended: its state and report, and for each failed step its exit,
    the end of its stderr and where to look next."""
    lines = []
    for step in run.steps:
        if step.state != "failed":
            continue
        code = f"exit {step.exit_code}" if step.exit_code is not None else "no exit code"
        where = f" on {step.node_id}" if step.node_id else ""
        lines.append(f"step {step.name} failed ({code}{where}, attempt {step.attempt})"
                     + (f": {step.reason}" if step.reason else ""))
        tail = stderr_tail(step)
        if tail:
            lines.append("  its stderr ends with:")
            lines += [f"    {line}" for line in tail]
        lines.append(f"  all of its output: m27 logs {run.run_id} {step.name}; every "
                     f"attempt: m27 show {run.run_id}")
    return [*lines, f"run {run.state}" + (f"; report: {report_path}" if report_path else "")]


def print_outcome(run: RunRecord, report_path: str) -> None:
    print("\n".join(outcome_lines(run, report_path)))


def exit_code_for(run: RunRecord) -> int:
    """0 succeeded, 1 failed, 3 cancelled, 4 still running."""
    return EXIT_CODES.get(run.state, 4)
