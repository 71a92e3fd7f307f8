"""`m27 node maintain NODE --at 03:00 [--every day] --command …` and `m27 node windows`:
maintenance windows (m27.common.windows), set through the scheduler's API."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Final

from m27.cli._common import print_json
from m27.client.scheduler import SchedulerClient, WindowStatus
from m27.common.errors import M27Error
from m27.common.units import format_duration, parse_duration
from m27.common.windows import DEFAULT_LEAD_S, DEFAULT_TIMEOUT_S, EVERY

LOCALTIME: Final = Path("/etc/localtime")
EPILOG: Final = """\
maintenance windows:
  m27 node maintain gpu-02 --at 03:00 --every day --command "nvidia-smi --gpu-reset"
  m27 node maintain gpu-02 --at 22:30 --on 2026-12-24 --command "apt-get -y upgrade"
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
    if not args.at:
        raise M27Error("m27 node maintain needs --at HH:MM (or --clear)")
    return await client.set_window(
        args.node_id, at=args.at, tz=args.tz or local_zone(), every=args.every,
        first_day=args.on, command=args.command, lead_s=_seconds(args.lead, "--lead"),
        timeout_s=_seconds(args.command_timeout, "--command-timeout"))


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
