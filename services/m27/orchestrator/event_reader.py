"""Reading the events stream for one `WatchEvents` feed: its filter and start (`event_feed`)
over the paged ordered consumers of `m27.common.stream_pages`."""

from __future__ import annotations

from nats.js import JetStreamContext

from m27.common import subjects
from m27.common.stream_pages import PAGE, StartAt, StreamPages
from m27.orchestrator import event_feed

__all__ = ["PAGE", "EventReader"]


def start_at(start: event_feed.Start) -> StartAt:
    if start.policy == "sequence":
        return StartAt(policy="sequence", sequence=start.sequence)
    if start.policy == "time":
        return StartAt(policy="time", time=start.time)
    return StartAt(policy="sequence", sequence=1)  # "all": from the stream's first


class EventReader(StreamPages):
    """The feed's messages in stream order, across pages."""

    def __init__(self, js: JetStreamContext, run_id: str, start: event_feed.Start) -> None:
        super().__init__(js, subjects.EVENTS_STREAM, event_feed.filters(run_id),
                         start_at(start))
