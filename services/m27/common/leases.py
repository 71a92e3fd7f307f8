"""Who may act: one active copy of a service at a time, by a lease in KV (pure rules).

A copy that wants to act (`m27.common.leader` is the shell) holds the key
`<service>` of `subjects.LEASES_BUCKET`. The rules that keep two copies from ever acting
at once, given that a process may stall (a long GC pause, SIGSTOP, a VM migration) and
that clocks are only compared on one machine:

- The holder renews by compare-and-set on the key's revision. It may act only until
  `ttl` after the *start* of its last renewal that succeeded, by its own monotonic clock
  (`holder_may_act`). A renewal that fails on the revision means another copy took over:
  it stops at once.
- A standby takes over only when it has seen the same revision for `ttl + margin`
  by its own monotonic clock (`standby_may_take`), then by compare-and-set on that
  revision, with the next fencing `token`. It first saw that revision after the holder
  wrote it, so the holder's right to act ran out at least `margin` before.
- `token` only grows: whatever a copy writes can carry it, and a reader can refuse what a
  deposed copy wrote late.
"""

from __future__ import annotations

from typing import Final

import msgspec

#: How long a holder may act after the start of its last successful renewal.
DEFAULT_TTL_S: Final = 10.0
#: What a standby waits beyond the ttl (clock rates differ a little; a renewal is slow).
DEFAULT_MARGIN_S: Final = 2.0


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """The value at `LEASES_BUCKET/<service>`."""

    holder: str  # the copy: instance name and a random part, unique per process; "": free
    token: int  # the fencing token: one more at every takeover
    ttl_s: float
    renewed_at: float = 0.0  # the holder's wall clock: for people, never for decisions
    host: str = ""
    pid: int = 0


def holder_may_act(renew_started: float, now: float, ttl_s: float) -> bool:
    """May the holder still act at `now` (monotonic), its last successful renewal having
    started at `renew_started`?"""
    return now < renew_started + ttl_s


def standby_may_take(first_seen: float, now: float, ttl_s: float, margin_s: float) -> bool:
    """May a standby take a lease whose revision it first saw at `first_seen` and has seen
    unchanged since?"""
    return now >= first_seen + ttl_s + margin_s


def successor(current: Lease | None, holder: str, ttl_s: float, renewed_at: float,
              host: str = "", pid: int = 0) -> Lease:
    """The lease a copy writes when it takes over from `current` (None: nobody held it)."""
    token = (current.token if current is not None else 0) + 1
    return Lease(holder=holder, token=token, ttl_s=ttl_s, renewed_at=renewed_at,
                 host=host, pid=pid)
