"""Maintenance windows (pure): when a node's next window starts, and whether a task may be
placed on a node whose window is near.

A window is a wall-clock time of day in a named time zone (`03:00` Europe/Berlin), once or
every day or week, with the command the node's agent runs in it (a GPU reset), the lead
before it during which new work that would not end or checkpoint in time is kept off the
node, and the command's time limit. Occurrences are computed in the zone, so a daily
window stays at 03:00 across daylight-saving changes; a time the clocks skip that day is
read with the offset before the jump (02:30 becomes 03:30), and one that occurs twice is
taken the first time.

The scheduler drives a window (service shell): at its start it drains the node
(checkpointing work is stopped and moves elsewhere, the rest is stopped and retried
elsewhere), sends the command once the node is empty, and uncordons the node when the
command succeeds.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec

from m27.common.errors import InvalidRequest
from m27.common.ids import is_valid_name
from m27.common.units import parse_duration

Every = Literal["once", "day", "week"]
EVERY: Final[tuple[Every, ...]] = ("once", "day", "week")
DEFAULT_LEAD_S: Final = 2 * 3600.0
DEFAULT_TIMEOUT_S: Final = 600.0
MAX_COMMAND_CHARS: Final = 4096
MAX_LEAD_S: Final = 7 * 86400.0
MAX_TIMEOUT_S: Final = 86400.0
_HHMM: Final = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?")


class WindowError(InvalidRequest):
    """A window that cannot be set; the message says what is accepted."""


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """A node's maintenance window, as set (`m27 node maintain`)."""

    node_id: str
    at: str  # "HH:MM" (or "HH:MM:SS"), wall-clock time in `tz`
    tz: str = "UTC"  # an IANA zone name
    every: Every = "once"
    first_day: str = ""  # ISO date of the first occurrence ("" the next `at` from `created`)
    command: str = ""  # run by the node's agent through /bin/sh; "" drain and return only
    lead_s: float = DEFAULT_LEAD_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    created: float = 0.0
    created_by: str = ""


def check_window(window: Window) -> Window:
    """`window` if every field is acceptable; WindowError naming the field otherwise."""
    if not _HHMM.fullmatch(window.at):
        raise WindowError(f"--at {window.at[:40]!r}: expected a time of day HH:MM (or "
                          "HH:MM:SS), e.g. 03:00")
    zone(window.tz)
    if window.every not in EVERY:
        raise WindowError(f"--every {str(window.every)[:40]!r}: expected one of "
                          f"{', '.join(EVERY)}")
    if window.first_day:
        try:
            dt.date.fromisoformat(window.first_day)
        except ValueError as exc:
            raise WindowError(f"first day {window.first_day[:40]!r}: expected YYYY-MM-DD"
                              ) from exc
    if len(window.command) > MAX_COMMAND_CHARS or "\x00" in window.command:
        raise WindowError(f"--command: at most {MAX_COMMAND_CHARS} characters and no NUL")
    for name, value, most in (("--lead", window.lead_s, MAX_LEAD_S),
                              ("--timeout", window.timeout_s, MAX_TIMEOUT_S)):
        if not math.isfinite(value) or not 0 <= value <= most:
            raise WindowError(f"{name}: between 0 s and {most:.0f} s, got {value!r}")
    if window.timeout_s <= 0:
        raise WindowError("--timeout: the command needs more than 0 s")
    return window


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise WindowError(f"time zone {name[:60]!r} is not known (an IANA name such as "
                          "Europe/Berlin or UTC)") from exc


def _wall(day: dt.date, hhmm: str, tz: ZoneInfo) -> float:
    """The instant the clocks in `tz` show `hhmm` on `day`: the first of two (clocks going
    back); a time the clocks skip is read with the offset before the jump (02:30 on a day
    that jumps from 02:00 to 03:00 is 03:30)."""
    hour, minute, second = (int(part) for part in (hhmm + ":0").split(":")[:3])
    return dt.datetime.combine(day, dt.time(hour, minute, second), tzinfo=tz).timestamp()


def occurrence_after(window: Window, after: float) -> float | None:
    """The start of the first occurrence at or after `after` (None: a `once` window that
    is over)."""
    tz = zone(window.tz)
    today = dt.datetime.fromtimestamp(after, tz).date()
    first = dt.date.fromisoformat(window.first_day) if window.first_day else None
    if window.every == "once" and first is not None:  # that day's, or none at all
        start = _wall(first, window.at, tz)
        return start if start >= after else None
    day = max(today, first) if first else today
    step = {"once": 0, "day": 1, "week": 7}[window.every]
    for _ in range(3):  # today's may have passed: the next day's (or week's) has not
        start = _wall(day, window.at, tz)
        if start >= after:
            return start
        if step == 0 and first is not None:
            return None  # a `once` window on a given day that has passed
        day += dt.timedelta(days=step or 1)
    return None


def pinned(window: Window, now: float) -> Window:
    """A `once` window with its day fixed (the next `at` after `now`), so it happens once
    whenever it is read again; others as they are."""
    if window.every != "once" or window.first_day:
        return window
    start = occurrence_after(window, now)
    assert start is not None  # no first day: there is always a next `at`
    day = dt.datetime.fromtimestamp(start, zone(window.tz)).date()
    return msgspec.structs.replace(window, first_day=day.isoformat())


def parse_config(text: str) -> list[Window]:
    """`[scheduler] windows`, one window per line (a node list shares it):

        NODE[,NODE…] HH:MM once|day|week [ZONE] [on=YYYY-MM-DD] [lead=2h] [timeout=10m] -> COMMAND

    e.g. `gpu-01,gpu-02 03:00 day Europe/Berlin -> nvidia-smi --gpu-reset`. WindowError
    naming the line for anything else."""
    found: list[Window] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"[scheduler] windows, line {number}"
        head, arrow, command = line.partition("->")
        fields = head.split()
        if not arrow or len(fields) < 3:
            raise WindowError(f"{where}: expected NODE[,NODE…] HH:MM once|day|week [ZONE] "
                              "[on=YYYY-MM-DD] [lead=2h] [timeout=10m] -> COMMAND")
        nodes, at, every, *rest = fields
        options: dict[str, str] = {"tz": "UTC"}
        for item in rest:
            key, sep, value = item.partition("=")
            if not sep:
                options["tz"] = item
            elif key in ("on", "lead", "timeout"):
                options[key] = value
            else:
                raise WindowError(f"{where}: unknown option {key[:40]!r} (on, lead, timeout)")
        try:
            lead = parse_duration(options.get("lead", f"{DEFAULT_LEAD_S}"))
            limit = parse_duration(options.get("timeout", f"{DEFAULT_TIMEOUT_S}"))
        except ValueError as exc:
            raise WindowError(f"{where}: {exc}") from exc
        if every not in EVERY:
            raise WindowError(f"{where}: {every[:40]!r} is not once, day or week")
        if every == "once" and "on" not in options:
            raise WindowError(f"{where}: a once window in the config needs on=YYYY-MM-DD "
                              "(else every restart would schedule it again)")
        for node in nodes.split(","):
            if not is_valid_name(node):
                raise WindowError(f"{where}: {node[:60]!r} is not a node name")
            try:
                found.append(check_window(Window(
                    node_id=node, at=at, tz=options["tz"],
                    every=every,  # checked above
                    first_day=options.get("on", ""), command=command.strip(), lead_s=lead,
                    timeout_s=limit, created_by="config")))
            except WindowError as exc:
                raise WindowError(f"{where}: {exc}") from None
    return found


def same_window(a: Window, b: Window) -> bool:
    """The same window, whoever set it when."""
    return msgspec.structs.replace(a, created=0.0, created_by="") == \
        msgspec.structs.replace(b, created=0.0, created_by="")


def blocks(window_in_s: float | None, *, checkpoints: bool, runs_for_s: float | None) -> bool:
    """Whether a task must not be placed on a node whose window starts in `window_in_s`
    (None: none within its lead): unless it checkpoints (it is stopped at the window
    losing little) or its time limit ends it before the window."""
    if window_in_s is None or checkpoints:
        return False
    return runs_for_s is None or runs_for_s > window_in_s
