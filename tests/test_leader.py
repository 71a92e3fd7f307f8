"""One active copy: the lease in KV on a real nats-server. Two copies never act at once,
a copy that stops hands over at once, one that dies is replaced after its lease, and one
that was stalled and deposed stops acting (and writing) before it could collide."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common import events, leases, subjects
from m27.common.bus import NatsBus
from m27.common.leader import (
    FencedBus,
    Leadership,
    NotLeader,
    _died_here,
    cancelled,
    this_host,
)
from tests.support import wait_for

pytestmark = pytest.mark.integration


@given(st.floats(0, 1e6), st.floats(0, 100), st.floats(0, 1e3), st.floats(0.1, 100),
       st.floats(0, 10))
def test_a_holder_and_a_standby_never_may_act_at_the_same_time(
        renewed: float, seen_after: float, at: float, ttl: float, margin: float) -> None:
    """The standby first saw the holder's last renewal after it began (`seen_after` ≥ 0)."""
    now = renewed + at
    assert not (leases.holder_may_act(renewed, now, ttl)
                and leases.standby_may_take(renewed + seen_after, now, ttl, margin))


class Copy:
    """One copy of a service: its leadership and an `act` that records when it ran."""

    def __init__(self, nats: NatsBus, name: str, ttl_s: float = 1.0,
                 clock: object = time.monotonic) -> None:
        self.leadership = Leadership(nats, "scheduler", name, ttl_s=ttl_s, margin_s=0.5,
                                     clock=clock)  # type: ignore[arg-type]
        self.acting = False
        self.acts = 0
        self.swallowed = 0
        self.stubborn = False
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def act(self) -> None:
        self.acting = True
        self.acts += 1
        try:
            if self.stubborn:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:  # as asyncio.wait_for can on Python 3.11
                    self.swallowed += 1
            await asyncio.Event().wait()
        finally:
            self.acting = False

    def start(self) -> Copy:
        self.task = asyncio.create_task(self.leadership.run(self.act, self.stop))
        return self


async def test_one_copy_acts_hands_over_at_once_and_a_dead_one_is_replaced(
        nats_url: str) -> None:
    nats = await NatsBus.open(nats_url, name="test-leader")
    try:
        a = Copy(nats, "a").start()
        await wait_for(lambda: a.acting, "a acts")
        b = Copy(nats, "b").start()
        await asyncio.sleep(0)
        watch_until = time.monotonic() + 2.5  # longer than a's lease: it renews
        while time.monotonic() < watch_until:
            assert not b.acting
            await asyncio.sleep(0.05)
        a.stop.set()  # a graceful stop gives the lease up: b need not wait it out
        began = time.monotonic()
        await wait_for(lambda: b.acting, "b takes over")
        assert time.monotonic() - began < 1.0
        assert b.leadership.token == a.leadership.token + 1
        assert b.task is not None
        b.task.cancel()  # b dies without a word: its lease is left to run out
        c = Copy(nats, "c").start()
        began = time.monotonic()
        await wait_for(lambda: c.acting, "c takes over from the dead b")
        assert time.monotonic() - began >= 1.0 + 0.5 - 0.3  # ttl + margin (a poll early)
        assert c.leadership.token == b.leadership.token + 1
        c.stop.set()
        assert c.task is not None
        await c.task
    finally:
        await nats.close()


async def test_a_deposed_copy_stops_acting_and_its_writes_are_refused(nats_url: str) -> None:
    nats = await NatsBus.open(nats_url, name="test-leader")
    try:
        now = [0.0]
        a = Copy(nats, "a", ttl_s=5.0, clock=lambda: now[0]).start()
        await wait_for(lambda: a.acting, "a acts")
        fenced = FencedBus(nats, a.leadership)
        ready = events.ReportReady(at=1.0, run_id="r-1", path="/x")
        await fenced.publish(subjects.run_report("r-1"), ready)
        now[0] += 5.0  # a stalled past its lease (by its own clock): it may not write
        with pytest.raises(NotLeader):
            await fenced.publish(subjects.run_report("r-1"), ready)
        await wait_for(lambda: not a.acting, "a notices and stops acting")
        now[0] += 100.0
        a.stop.set()
        assert a.task is not None
        await a.task
        # deposed: another copy took the key while this one was stalled
        x = Copy(nats, "x", ttl_s=5.0).start()
        await wait_for(lambda: x.acting, "x acts")
        kv = await nats.kv(subjects.LEASES_BUCKET)
        await kv.put("scheduler", msgspec.json.encode(
            leases.Lease(holder="y", token=99, ttl_s=5.0)))
        await wait_for(lambda: not x.acting, "x learns it was deposed at its next renewal",
                       timeout=10)
        assert not x.leadership.may_act()
        x.stop.set()
        assert x.task is not None
        await x.task
    finally:
        await nats.close()


def test_a_holder_is_known_dead_only_in_its_own_pid_namespace() -> None:
    """Two pods of one Deployment share a host name (and may reuse each other's pids) but
    not a PID namespace: only a holder that ran in this very namespace of this machine is
    known dead by its pid; any other is waited out."""
    gone = subprocess.Popen(["true"])  # a pid that existed here and is reaped now
    gone.wait()
    here = this_host()
    assert here.split("|")[0] == socket.gethostname()
    assert len(here.split("|")) == 3
    dead_here = leases.Lease(holder="a-1", token=1, ttl_s=10.0, renewed_at=0.0,
                             host=here, pid=gone.pid)
    assert _died_here(dead_here)
    other_pod = msgspec.structs.replace(dead_here, host=f"{socket.gethostname()}|x|pid:[1]")
    assert not _died_here(other_pod)
    bare_name = msgspec.structs.replace(dead_here, host=socket.gethostname())  # older copies
    assert not _died_here(bare_name)
    alive = msgspec.structs.replace(dead_here, pid=os.getppid())
    assert not _died_here(alive)


async def test_a_copy_whose_acting_swallows_a_cancellation_still_steps_down_and_acts_again(
        nats_url: str) -> None:
    """Found by the chaos suite: a scheduler stopped past its lease never acted again (its
    acting task lost the cancellation and the copy waited for it forever)."""
    nats = await NatsBus.open(nats_url, name="test-leader")
    try:
        now = [0.0]
        a = Copy(nats, "a", ttl_s=5.0, clock=lambda: now[0])
        a.stubborn = True
        a.start()
        await wait_for(lambda: a.acting, "a acts")
        now[0] += 5.0  # stalled past its lease
        await wait_for(lambda: not a.acting, "a stops acting although it swallowed a cancel")
        assert a.swallowed == 1
        now[0] += 100.0  # nobody renewed the lease: a takes it again
        await wait_for(lambda: a.acting and a.acts == 2, "a acts again")
        a.stop.set()
        assert a.task is not None
        await a.task
    finally:
        await nats.close()


async def test_cancelled_ends_a_task_and_may_be_asked_again() -> None:
    task = asyncio.create_task(asyncio.Event().wait())
    await cancelled(task)
    await cancelled(task)  # (a cached coroutine could not be awaited twice)
    assert task.cancelled()
    assert this_host() is this_host()  # worked out once
