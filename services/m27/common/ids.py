"""Identifiers that travel in NATS subjects and KV keys, so they use a safe alphabet."""

from __future__ import annotations

import re
import secrets
import time

# One NATS subject token / KV key segment: no dots, wildcards, spaces or slashes.
# ASCII only and matched in full: `$` would accept a trailing newline, `\d` any Unicode digit.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}"
NAME_RE = re.compile(NAME_PATTERN)
RUN_ID_RE = re.compile(r"r-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")


def is_valid_name(name: str) -> bool:
    """Step names and node ids: letters, digits, `_` and `-`, starting with a letter or digit."""
    return NAME_RE.fullmatch(name) is not None


def new_run_id(now: float, token: str | None = None) -> str:
    """`r-YYYYMMDD-HHMMSS-xxxxxx` in UTC: sorts by submission time, readable in a terminal."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"r-{stamp}-{token or secrets.token_hex(3)}"


def is_valid_run_id(run_id: str) -> bool:
    return RUN_ID_RE.fullmatch(run_id) is not None


def task_id(run_id: str, step: str) -> str:
    """A step of a run as one schedulable unit: `<run_id>/<step>`."""
    return f"{run_id}/{step}"


def split_task_id(value: str) -> tuple[str, str]:
    """The (run_id, step) of a task id; ValueError when it is not of that form."""
    run_id, sep, step = value.partition("/")
    if not sep or not is_valid_run_id(run_id) or not is_valid_name(step):
        raise ValueError(f"not a task id of the form <run_id>/<step>: {value!r}")
    return run_id, step


def is_valid_task_id(value: str) -> bool:
    try:
        split_task_id(value)
    except ValueError:
        return False
    return True
