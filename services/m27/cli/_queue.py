"""`m27 queue [--explain]` and `m27 node cordon|drain|uncordon NODE`: the scheduler's view.

These talk to the scheduler's own API (`m27.v1.SchedulerService`): `--scheduler HOST:PORT`,
`$M27_SCHEDULER`, else the scheduler of the embedded system `m27 up` started. Rendering is
pure (lines from `QueueItem` / `NodeMaintenance` values).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from m27.cli import _windows
from m27.cli._common import Subparsers, add, print_json, service_address
from m27.cli._live import FitTable, console, table
from m27.client.scheduler import Action, NodeMaintenance, QueueItem, SchedulerClient
from m27.common.errors import M27Error
from m27.common.units import format_duration

T = TypeVar("T")
SCHEDULER_ENV: Final = "M27_SCHEDULER"
PROCESS_NAME: Final = "scheduler"
EMPTY: Final = "the queue is empty: nothing waits or runs"
SCORE_TERMS: Final = (("urgency", "+"), ("level", "+"), ("aging", "+"), ("held", "−"))


def add_commands(sub: Subparsers) -> None:
    queue = add(sub, "queue", "the scheduler's tasks: waiting ones in the order the policy "
                "takes them (with why each waits), then running, paused and stopping ones",
                cmd_queue)
    queue.add_argument("--explain", action="store_true",
                       help="each waiting task's score broken down, and why it waits")
    queue.add_argument("--json", action="store_true", help="machine-readable output")
    _scheduler_option(queue)
    node = add(sub, "node", "node maintenance: cordon (no new work), drain (no new work; "
               "checkpointing tasks are checkpointed and moved), uncordon; maintain (a "
               "maintenance window: drain, run a command, return), windows (list them)",
               cmd_node)
    node.formatter_class = argparse.RawDescriptionHelpFormatter
    node.epilog = _windows.EPILOG
    node.add_argument("action", choices=("cordon", "drain", "uncordon", "maintain", "windows"))
    node.add_argument("node_id", metavar="NODE", nargs="?", default="",
                      help="the node (every action but windows)")
    node.add_argument("--reason", default="", help="shown in `m27 nodes` and the logs")
    node.add_argument("--json", action="store_true", help="machine-readable output")
    node.add_argument("--wait", action="store_true",
                      help="(cordon, drain) return only once no task is placed on the node, "
                      "showing what is left, so a maintenance command can follow: "
                      "`m27 node drain gpu-02 --wait && ssh gpu-02 nvidia-smi -r`")
    node.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                      help="with --wait: give up (exit 1) after this long (default 3600)")
    _windows.add_arguments(node)
    _scheduler_option(node)


def _scheduler_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", metavar="HOST:PORT",
                        help=f"scheduler address (default: ${SCHEDULER_ENV}, or the "
                        "embedded system's)")


def scheduler_address(explicit: str | None, environ: Mapping[str, str], home: Path) -> str:
    """--scheduler, $M27_SCHEDULER, else the embedded system's scheduler process."""
    return service_address(explicit, environ, home, variable=SCHEDULER_ENV,
                           process=PROCESS_NAME, flag="--scheduler")


def with_scheduler(args: argparse.Namespace,
                   work: Callable[[SchedulerClient], Awaitable[T]]) -> T:
    address = scheduler_address(getattr(args, "scheduler", None), os.environ, args.home)

    async def run() -> T:
        async with SchedulerClient(address) as client:
            return await work(client)

    return asyncio.run(run())


# ---------------------------------------------------------------- rendering (pure)


def score_line(explanation: Mapping[str, Any]) -> str | None:
    """`score 323.4 = urgency 300 + level 0 + aging 23.4 − held 0`, from the policy's
    explanation (None when it carries no score terms)."""
    score = explanation.get("score")
    if not isinstance(score, Mapping) or "total" not in score:
        return None
    terms = [f"{sign} {name} {float(score[name]):g}" for name, sign in SCORE_TERMS
             if name in score]
    text = f"score {float(score['total']):.1f} = " + " ".join(terms).lstrip("+ ")
    level = score.get("user_level")
    return f"{text} (user level {level})" if level else text


def _other_lines(explanation: Mapping[str, Any]) -> list[str]:
    skip = {"score", "task_id", "reason"}
    notes = {"staged_on": " (ready pool: its inputs are read ahead there)"}
    return [f"{key}: {_value(value)}{notes.get(key, '')}"
            for key, value in explanation.items()
            if key not in skip and value not in (None, "", [], {})]


def _value(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def preempted_note(item: QueueItem) -> str:
    """` [preempted 3×, 2 in a row before any checkpoint]`; "" if never preempted."""
    if not item.preemptions:
        return ""
    fruitless = (f", {item.fruitless_preemptions} in a row before any checkpoint"
                 if item.fruitless_preemptions else "")
    return f" [preempted {item.preemptions}×{fruitless}]"


def protection_line(item: QueueItem) -> str:
    """For a placed task under --explain: whether the policy may preempt it now."""
    return f"protected: {item.protected}" if item.protected else "may be preempted now"


def _staging_text(item: QueueItem) -> str:
    """"inputs staged on n1, n2; staging on n3"."""
    parts = []
    if item.staged_on:
        parts.append(f"inputs staged on {', '.join(item.staged_on)}")
    if item.staging_on:
        parts.append(f"staging inputs on {', '.join(item.staging_on)}")
    return "; ".join(parts)


COLUMNS: Final = ("#", "TASK", "STATE", "URGENCY", "GPU", "WAITED", "SCORE", "WHERE / WHY")


def queue_row(n: int, item: QueueItem, now: float) -> tuple[str, ...]:
    where = item.reason if item.state == "waiting" else item.node_id + (
        f" (backfill into {item.lender})" if item.lender else "")
    if item.state == "waiting" and (item.staged_on or item.staging_on):
        where += f" [ready pool: {_staging_text(item)}]"
    where += preempted_note(item)
    score = f"{item.score:.1f}" if item.explanation is not None else "—"
    waited = format_duration(max(0.0, now - item.queued_at))
    return (str(n), item.task_id, item.state, item.urgency, f"{item.gpus:g}", waited, score,
            where)


def explain_lines(item: QueueItem) -> list[str]:
    """Under --explain: a waiting task's score and reasons, a placed one's protection."""
    if item.explanation is not None and item.state == "waiting":
        line = score_line(item.explanation)
        return ([line] if line else []) + _other_lines(item.explanation)
    if item.state != "waiting":
        return [protection_line(item)]
    return []


def render_queue(items: Sequence[QueueItem], now: float, explain: bool) -> list[str]:
    """The queue as plain lines (output that is not a terminal)."""
    if not items:
        return [EMPTY]
    width = max(4, *(len(i.task_id) for i in items))
    lines = [f"{'#':>3}  {'TASK':<{width}}  {'STATE':<8}  {'URGENCY':<7}  {'GPU':>4}  "
             f"{'WAITED':>8}  {'SCORE':>7}  WHERE / WHY"]
    for n, item in enumerate(items, 1):
        num, task, state, urgency, gpus, waited, score, where = queue_row(n, item, now)
        lines.append(f"{num:>3}  {task:<{width}}  {state:<8}  {urgency:<7}  {gpus:>4}  "
                     f"{waited:>8}  {score:>7}  {where}".rstrip())
        if explain:
            lines.extend(f"       {text}" for text in explain_lines(item))
    return lines


def queue_table(items: Sequence[QueueItem], now: float, explain: bool) -> FitTable:
    """The queue on a terminal: a table cut to its width (the reasons give way first)."""
    rows: list[tuple[str, ...]] = []
    for n, item in enumerate(items, 1):
        rows.append(queue_row(n, item, now))
        if explain:
            rows.extend(("", "", "", "", "", "", "", f"  {text}") for text in
                        explain_lines(item))
    return table(COLUMNS, rows, right=("#", "GPU", "WAITED", "SCORE"),
                 squeeze=("WHERE / WHY", "TASK"))


def render_maintenance(mark: NodeMaintenance) -> str:
    if not mark.state:
        return f"{mark.node_id}: in service (takes new work)"
    why = f" ({mark.reason})" if mark.reason else ""
    left = ("empty: a maintenance command can run now" if mark.tasks == 0
            else f"{mark.tasks} task(s) still placed there")
    return f"{mark.node_id}: {mark.state}{why}; {left}"


# ---------------------------------------------------------------- commands


def cmd_queue(args: argparse.Namespace) -> int:
    items = with_scheduler(args, lambda c: c.queue(explain=args.explain or args.json))
    if args.json:
        print_json(items)
    elif items and sys.stdout.isatty():
        console(sys.stdout).print(queue_table(items, time.time(), args.explain))
    else:
        print("\n".join(render_queue(items, time.time(), args.explain)))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    if args.action == "windows":
        _windows.show(with_scheduler(args, lambda c: c.windows()), args)
        return 0
    if not args.node_id:
        raise M27Error(f"m27 node {args.action} needs a NODE (`m27 nodes` lists them)")
    if args.action == "maintain":
        window = with_scheduler(args, lambda c: _windows.maintain(c, args))
        _windows.show([window], args, cleared=args.clear)
        return 0
    action: Action = args.action
    if args.wait and action == "uncordon":
        raise M27Error("--wait applies to cordon and drain (waiting for the node to empty)")
    mark = with_scheduler(args, lambda c: c.set_maintenance(args.node_id, action,
                                                            args.reason))
    if args.wait and mark.tasks:
        mark = with_scheduler(args, lambda c: wait_until_empty(
            c, args.node_id, args.timeout, show=None if args.json else print))
    if args.json:
        print_json(mark)
    else:
        print(render_maintenance(mark))
    return 0


async def wait_until_empty(client: SchedulerClient, node_id: str, timeout_s: float,
                           show: Callable[[str], None] | None,
                           poll_s: float = 1.0) -> NodeMaintenance:
    """Poll until no task is placed on the node; each change of what is left is shown."""
    deadline, shown = time.monotonic() + timeout_s, -1
    while True:
        mark = next((m for m in await client.maintenance() if m.node_id == node_id), None)
        if mark is None or not mark.state:
            raise M27Error(f"{node_id} was put back in service while waiting for it to empty")
        if mark.tasks == 0:
            return mark
        if show is not None and mark.tasks != shown:
            show(f"{node_id}: waiting for {mark.tasks} task(s) to finish or move ...")
            shown = mark.tasks
        if time.monotonic() >= deadline:
            raise M27Error(f"{node_id} still has {mark.tasks} task(s) after {timeout_s:g}s "
                           "(it stays cordoned/draining)")
        await asyncio.sleep(poll_s)


def maintenance_states(args: argparse.Namespace) -> dict[str, str]:
    """node → cordoned / draining, for `m27 nodes`; empty when the scheduler cannot be
    reached (the nodes view does not depend on it)."""
    try:
        marks = with_scheduler(args, lambda c: c.maintenance())
    except M27Error:
        return {}
    return {m.node_id: m.state for m in marks if m.state}
