"""What `WatchEvents` sends: a feed's filter and start, whose event a subject carries, and
when a feed has caught up (pure; the servicer in `api.py` reads the stream).

A feed reads the events stream with one ephemeral ordered consumer. A run's events lie
under two subjects (`m27.events.run.<run_id>.>` and `m27.events.task.<run_id>.>`), so a
run's feed filters on both; a feed of every event filters on none, and the servicer asks
`api_access.sees_event` for each, by the run or node its subject names.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final, Generic, Literal, TypeVar

import msgspec

from m27.common import subjects
from m27.v1 import pipeline_pb2 as pb

T = TypeVar("T")

#: Events before now a feed of every event starts with, unless asked otherwise.
DEFAULT_LIMIT: Final = 200
#: The most events before now a feed keeps (a run's feed buffers them until caught up).
MAX_LIMIT: Final = 5000

StartPolicy = Literal["all", "sequence", "time"]


class FeedQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A `WatchEventsRequest`, checked."""

    run_id: str = ""
    follow: bool = False
    since_s: float = 0.0
    limit: int = 0

    @classmethod
    def from_request(cls, request: pb.WatchEventsRequest) -> FeedQuery:
        """ValueError says what is wrong with the request's numbers."""
        if not 0 <= request.limit <= MAX_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_LIMIT} (0: the default), "
                             f"got {request.limit}")
        if not math.isfinite(request.since_s) or request.since_s < 0:
            raise ValueError(f"since_s must be a number of seconds, 0 or more, "
                             f"got {request.since_s}")
        return cls(run_id=request.run_id, follow=request.follow, since_s=request.since_s,
                   limit=request.limit)


class Start(msgspec.Struct, frozen=True, kw_only=True):
    """Where the consumer starts, and how many of the events before now the feed keeps
    (`keep_last` 0: all of them; N: the latest N, sent once it has caught up)."""

    policy: StartPolicy
    sequence: int = 0
    time: float = 0.0
    keep_last: int = 0


def start_of(query: FeedQuery, last_sequence: int, now: float) -> Start:
    """`since_s`: from that long ago; a run: all of its events; otherwise the stream's last
    `limit` (default `DEFAULT_LIMIT`) events, found by sequence (the stream holds every
    event, so its last N are the N before its last sequence)."""
    if query.since_s:
        return Start(policy="time", time=max(0.0, now - query.since_s),
                     keep_last=query.limit)
    if query.run_id:
        return Start(policy="all", keep_last=query.limit)
    limit = query.limit or DEFAULT_LIMIT
    return Start(policy="sequence", sequence=max(1, last_sequence - limit + 1))


def filters(run_id: str) -> tuple[str, ...]:
    """The consumer's subject filters: one run's events, or (no run) every event."""
    if not run_id:
        return (subjects.EVENTS_ALL,)
    return (subjects.run_events(run_id), subjects.task_events_of(run_id, "*"))


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """Whose event a subject carries: a run's (`run_id`), a node's, or neither."""

    run_id: str = ""
    node: bool = False


_EVENTS: Final = f"{subjects.PREFIX}.events"


def scope_of(subject: str) -> Scope:
    """`m27.events.run.<run_id>.…` and `m27.events.task.<run_id>.…` are a run's,
    `m27.events.node.<node_id>` a node's; any other subject is neither."""
    parts = subject.split(".", 4)
    if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != _EVENTS or not parts[3]:
        return Scope()
    if parts[2] in ("run", "task"):
        return Scope(run_id=parts[3])
    if parts[2] == "node" and len(parts) == 4:
        return Scope(node=True)
    return Scope()


class Feed(Generic[T]):
    """A feed's progress: which items to send as events arrive, and whether it is done.

    `pending` is what the consumer says is left after an event (JetStream's num_pending);
    at 0 the feed has caught up with the stream as it was. Until then, with `keep_last`,
    only the latest events are kept (bounded), and sent on catching up. A feed that does
    not follow is done once caught up."""

    def __init__(self, *, keep_last: int, follow: bool, caught_up: bool) -> None:
        self.follow = follow
        self.caught_up = caught_up
        self._kept: deque[T] | None = deque(maxlen=keep_last) if keep_last else None

    @property
    def done(self) -> bool:
        return self.caught_up and not self.follow

    def take(self, item: T | None, pending: int) -> list[T]:
        """What to send after an event: `item` (None: one the caller may not see, which
        still counts for catching up), and on catching up what was kept."""
        if self.caught_up or self._kept is None:
            ready = [] if item is None else [item]
        else:
            if item is not None:
                self._kept.append(item)
            ready = []
        if pending == 0 and not self.caught_up:
            return [*self._flush(), *ready]
        return ready

    def idle(self) -> list[T]:
        """Nothing arrived for a while: whatever was still pending is gone (expired or
        deleted), so the feed has caught up."""
        return self._flush() if not self.caught_up else []

    def _flush(self) -> list[T]:
        self.caught_up = True
        kept = list(self._kept or ())
        self._kept = None
        return kept
