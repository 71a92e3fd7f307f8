"""`WatchEvents`' decisions: where a feed starts, whose event a subject carries, who sees
it, and when a feed has caught up (and, keeping a tail, what it sends then)."""

from __future__ import annotations

import pytest

from m27.common import api_access
from m27.common.tokens import ApiRole, Identity
from m27.orchestrator.event_feed import (
    MAX_LIMIT,
    Feed,
    FeedQuery,
    Scope,
    Start,
    filters,
    scope_of,
    start_of,
)
from m27.v1 import pipeline_pb2 as pb

RUN = "r-20261201-081500-a1b2c3"


def who(user: str = "alice", role: ApiRole = "user") -> Identity:
    return Identity(user=user, role=role, token_id="t")  # noqa: S106 - an id


@pytest.mark.parametrize(("subject", "scope"), [
    (f"m27.events.run.{RUN}.state", Scope(run_id=RUN)),
    (f"m27.events.run.{RUN}.step.train", Scope(run_id=RUN)),
    (f"m27.events.task.{RUN}.train.node-node-1", Scope(run_id=RUN)),
    ("m27.events.node.node-1", Scope(node=True)),
    ("m27.events.node.node-1.extra", Scope()),
    ("m27.events.run", Scope()),
    ("m27.metrics.x.y.z", Scope()),
    ("other.events.run.x.state", Scope()),
])
def test_a_subject_names_the_run_or_node_its_event_is_about(subject: str,
                                                            scope: Scope) -> None:
    assert scope_of(subject) == scope


def test_a_user_sees_node_events_and_their_own_runs_an_admin_everything() -> None:
    sees = api_access.sees_event
    assert sees(who(), node_event=True, run_owner=None)
    assert sees(who(), node_event=False, run_owner="alice")
    assert not sees(who(), node_event=False, run_owner="bob")
    assert not sees(who(), node_event=False, run_owner=None)  # unknown run or other subject
    assert sees(who("root", "admin"), node_event=False, run_owner="bob")
    assert sees(who("report", "service"), node_event=False, run_owner=None)


def test_where_a_feed_starts() -> None:
    every = FeedQuery()
    assert start_of(every, last_sequence=1000, now=50.0) == Start(policy="sequence",
                                                                   sequence=801)
    assert start_of(every, last_sequence=10, now=50.0).sequence == 1
    assert start_of(FeedQuery(limit=5), 1000, 50.0).sequence == 996
    assert start_of(FeedQuery(run_id=RUN), 1000, 50.0) == Start(policy="all")
    assert start_of(FeedQuery(run_id=RUN, limit=3), 1000, 50.0).keep_last == 3
    assert start_of(FeedQuery(since_s=20.0), 1000, 50.0) == Start(policy="time", time=30.0)
    assert start_of(FeedQuery(since_s=1e300), 1000, 50.0).time == 0.0
    assert filters("") == ("m27.events.>",)
    assert filters(RUN) == (f"m27.events.run.{RUN}.>", f"m27.events.task.{RUN}.*.>")


@pytest.mark.parametrize("request_", [
    pb.WatchEventsRequest(limit=-1), pb.WatchEventsRequest(limit=MAX_LIMIT + 1),
    pb.WatchEventsRequest(since_s=-1.0), pb.WatchEventsRequest(since_s=float("nan")),
    pb.WatchEventsRequest(since_s=float("inf")),
])
def test_out_of_range_numbers_are_refused(request_: pb.WatchEventsRequest) -> None:
    with pytest.raises(ValueError, match=r"limit|since_s"):
        FeedQuery.from_request(request_)


def test_a_feed_sends_as_it_goes_and_ends_when_caught_up_unless_it_follows() -> None:
    feed = Feed[int](keep_last=0, follow=False, caught_up=False)
    sent = [feed.take(1, pending=2), feed.take(None, pending=1)]  # None: not for the caller
    assert (sent, feed.done) == ([[1], []], False)
    assert (feed.take(3, pending=0), feed.done) == ([3], True)
    following = Feed[int](keep_last=0, follow=True, caught_up=False)
    following.take(1, pending=0)
    assert not following.done
    assert following.take(2, pending=0) == [2]
    assert Feed[int](keep_last=0, follow=False, caught_up=True).done  # nothing to send


def test_a_kept_tail_is_the_latest_events_sent_on_catching_up() -> None:
    feed = Feed[int](keep_last=2, follow=True, caught_up=False)
    assert [feed.take(n, pending=9 - n) for n in range(1, 9)] == [[]] * 8
    assert feed.take(9, pending=0) == [8, 9]
    assert feed.take(10, pending=0) == [10]  # live from now on
    idle = Feed[int](keep_last=2, follow=False, caught_up=False)
    idle.take(1, pending=5)
    assert (idle.idle(), idle.done) == ([1], True)  # the rest expired meanwhile
    assert idle.idle() == []
