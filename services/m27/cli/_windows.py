"""`m27 node maintain NODE --at 03:00 [--every day] --command …` and `m27 node windows`:
maintenance windows (m27.common.windows), set through the scheduler's API."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import time
from pathlib import Path
from typing import Final

from m27.cli._common import print_json
from m27.client.scheduler import SchedulerClient, WindowStatus
from m27.common.errors import M27Error
from m27.common.units import format_duration, parse_duration
from m27.common.windows import DEFAULT_LEAD_S, DEFAULT_TIMEOUT_S, EVERY, WindowError, zone

LOCALTIME: Final = Path("/etc/localtime")
MAX_IN_S: Final = 366 * 86400.0
EPILOG: Final = """\
maintenance windows:
  m27 node maintain gpu-02 --at 03:00 --every day --command "nvidia-smi --gpu-reset"
  m27 node maintain gpu-02 --at 22:30 --on 2026-12-24 --command "apt-get -y upgrade"
  m27 node maintain gpu-02 --in 15m --command "nvidia-smi --gpu-reset"   # once, soon
  m27 node maintain gpu-02 --clear           # no more windows for gpu-02
  m27 node windows                           # every node's window and where it stands

Within --lead of a window (default 2h) new work that would not end (its timeout) or
checkpoint before it goes to other nodes; at the window the node is cordoned and emptied
(checkpointing work moves, the rest is stopped and runs again elsewhere); then its
node-agent runs the command, and the node takes work again when it succeeds (it stays
cordoned when it fails). Each phase is a node_maintenance_window event (notifications).
"""


def add_arguments(node: argparse.ArgumentParser) -> None:
    group = node.add_argument_group("maintain (a maintenance window)")
    group.add_argument("--at", metavar="HH:MM", help="when the window starts, wall-clock "
                       "time in --tz (HH:MM:SS also works)")
    group.add_argument("--in", dest="in_", metavar="DURATION", default="",
                       help="instead of --at/--on: once, this long from now (e.g. 15m)")
    group.add_argument("--every", choices=EVERY, default="once",
                       help="once (default), every day or every week")
    group.add_argument("--on", metavar="YYYY-MM-DD", default="",
                       help="the first day (default: the next --at)")
    group.add_argument("--tz", metavar="ZONE", default="",
                       help="IANA time zone of --at (default: this machine's, else UTC)")
    group.add_argument("--command", default="", metavar="CMD",
                       help="run on the node by its agent through /bin/sh once it is empty "
                       "(default: none; the node is emptied and returned)")
    group.add_argument("--lead", default=f"{DEFAULT_LEAD_S:.0f}s", metavar="DURATION",
                       help="before the window, keep work that would be cut short off the "
                       "node for this long (default 2h)")
    group.add_argument("--command-timeout", default=f"{DEFAULT_TIMEOUT_S:.0f}s",
                       metavar="DURATION", help="the command's time limit (default 10m)")
    group.add_argument("--clear", action="store_true", help="remove the node's window")


def local_zone() -> str:
    """This machine's IANA zone: $TZ, else where /etc/localtime points, else UTC."""
    named = os.environ.get("TZ", "").lstrip(":")
    if (named and "/" in named) or named == "UTC":
        return named
    try:
        target = str(LOCALTIME.resolve())
    except OSError:
        return "UTC"
    _, found, zone = target.partition("zoneinfo/")
    return zone if found and zone else "UTC"


def _seconds(text: str, flag: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise M27Error(f"{flag}: {exc}") from exc


async def maintain(client: SchedulerClient, args: argparse.Namespace) -> WindowStatus:
    if args.clear:
        return await client.clear_window(args.node_id)
    tz = args.tz or local_zone()
    at, first_day = args.at, args.on
    if args.in_:
        if args.at or args.on or args.every != "once":
            raise M27Error("--in sets a single window from now: not with --at, --on or "
                           "--every")
        at, first_day = starting_in(_seconds(args.in_, "--in"), tz, time.time())
    if not at:
        raise M27Error("m27 node maintain needs --at HH:MM or --in DURATION (or --clear)")
    return await client.set_window(
        args.node_id, at=at, tz=tz, every=args.every,
        first_day=first_day, command=args.command, lead_s=_seconds(args.lead, "--lead"),
        timeout_s=_seconds(args.command_timeout, "--command-timeout"))


def starting_in(seconds: float, tz: str, now: float) -> tuple[str, str]:
    """(HH:MM:SS, YYYY-MM-DD) in `tz` of the whole second at or after `now + seconds`."""
    if not 0 <= seconds <= MAX_IN_S:
        raise M27Error(f"--in: between 0 s and {MAX_IN_S // 86400:.0f} days")
    try:
        start = dt.datetime.fromtimestamp(math.ceil(now + seconds), zone(tz))
    except WindowError as exc:
        raise M27Error(str(exc)) from exc
    return start.strftime("%H:%M:%S"), start.date().isoformat()


def render_window(window: WindowStatus, now: float, *, cleared: bool = False) -> str:
    """One line: when, what, where it stands, how the last one went."""
    if cleared:
        return f"{window.node_id}: maintenance window removed ({window.at} {window.tz})"
    when = {"once": f"once at {window.at}", "day": f"every day at {window.at}",
            "week": f"every week at {window.at}"}.get(window.every, window.at)
    if window.first_day:
        when += f" from {window.first_day}" if window.every != "once" else \
            f" on {window.first_day}"
    parts = [f"{window.node_id}: {when} {window.tz}"]
    if window.phase != "scheduled":
        parts.append(f"NOW {window.phase.upper()}")
    elif window.next_at:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(window.next_at))
        parts.append(f"next {stamp} (in {format_duration(max(0.0, window.next_at - now))})")
    else:
        parts.append("no occurrence left")
    parts.append(f"command: {window.command}" if window.command else "no command")
    parts.append(f"lead {format_duration(window.lead_s)}, limit "
                 f"{format_duration(window.timeout_s)}")
    if window.last:
        parts.append(f"last: {window.last}")
    if window.runs:
        parts.append(f"{window.runs} run(s)")
    return "; ".join(parts)


def status_notes(windows: list[WindowStatus], now: float) -> list[str]:
    """`m27 status`: windows in progress, starting within their lead, or that failed."""
    notes = []
    for window in windows:
        if window.phase != "scheduled":
            notes.append(f"  node {window.node_id}: maintenance window {window.phase}")
        elif window.next_at and window.next_at - now <= window.lead_s:
            notes.append(f"  node {window.node_id}: maintenance window in "
                         f"{format_duration(max(0.0, window.next_at - now))} (new work "
                         "that would be cut short goes elsewhere)")
        if window.last.startswith("failed"):
            notes.append(f"  node {window.node_id}: its last maintenance window "
                         f"{window.last}")
    return notes


def show(windows: list[WindowStatus], args: argparse.Namespace, *,
         cleared: bool = False) -> None:
    if args.json:
        print_json(windows)
        return
    if not windows:
        print("no maintenance windows (`m27 node maintain NODE --at 03:00 ...` sets one)")
    now = time.time()
    for window in windows:
        print(render_window(window, now, cleared=cleared))
