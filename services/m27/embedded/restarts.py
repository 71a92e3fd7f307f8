"""When `m27 up`'s supervisor starts a process again after it exits (pure, no clock inside).

Every exit is restarted after a backoff that doubles with each exit in a row
(`restart_backoff`, 2x, 4x … at most `restart_backoff_max`); an exit after the process
stayed up `stable_after` starts over at `restart_backoff`. The `give_up_after`-th exit
within `give_up_window` is not restarted: the process is crash-looping, and `m27 status`
says so instead of the supervisor starting it for ever. The supervisor applies the
`Decision`; `now` and `started_at` are its wall clock, so tests drive this with numbers.
"""

from __future__ import annotations

import signal
from typing import Final

import msgspec

from m27.common.config import SupervisorSection

#: The policy is `[supervisor]` of the config (docs/configuration.md).
RestartPolicy = SupervisorSection

_MAX_DOUBLINGS: Final = 32  # 2**32 x any backoff is past any sane cap: no float overflow


class History(msgspec.Struct, frozen=True, kw_only=True):
    """A process's recent exits: when each happened (those within the window, oldest
    first), and how many in a row came after less than `stable_after` up."""

    exits: tuple[float, ...] = ()
    quick_exits: int = 0


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """Start it again at `at` (`delay` after the exit), or not (it gave up); why, in words."""

    restart: bool
    at: float = 0.0
    delay: float = 0.0
    reason: str


def decide(policy: RestartPolicy, history: History, *, started_at: float,
           now: float) -> tuple[History, Decision]:
    """What to do about a process started at `started_at` that exited at `now`."""
    quick = 0 if now - started_at >= policy.stable_after else history.quick_exits
    exits = (*(t for t in history.exits if now - t < policy.give_up_window), now)
    after = History(exits=exits, quick_exits=quick + 1)
    if policy.give_up_after and len(exits) >= policy.give_up_after:
        return after, Decision(restart=False, reason=(
            f"gave up after {len(exits)} exits within {duration(policy.give_up_window)}"))
    delay = min(policy.restart_backoff_max,
                policy.restart_backoff * 2.0 ** min(quick, _MAX_DOUBLINGS))
    return after, Decision(restart=True, at=now + delay, delay=delay, reason=(
        f"restart in {duration(delay)} (exit {len(exits)} within "
        f"{duration(policy.give_up_window)})"))


def describe_exit(returncode: int | None) -> str:
    """`SIGKILL`, `exit code 3`, or `exited` when the status is unknown (Popen's
    returncode: negative for a signal)."""
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def duration(seconds: float) -> str:
    """`0.5s`, `30s`, `10m`, `1h30m`: short, for reasons and `m27 status`."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "",
             f"{secs}s" if secs else ""]
    return "".join(parts)
