"""The orchestrator's run store on a real NATS: a change that is stored stands even when
its messages cannot be published at once (a clustered JetStream electing a leader); they
go out later, once, without a restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.orchestrator import runs
from m27.orchestrator.store import RunStore
from m27.pipeline import load_pipeline

RUN = "r-20261205-120000-0a1b2c"
PIPELINE = """\
pipeline:
  - {name: prep, type: cpu, command: "echo prep"}
  - {name: train, type: gpu, command: "echo train", depends_on: [prep]}
"""


class RefusingBus(NatsBus):
    """Publishes fail while `refusing` is set, as during a stream leader election."""

    refusing = False

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None:
        if self.refusing:
            raise TimeoutError("nats: timeout (stream electing a leader)")
        await super().publish(subject, message, msg_id=msg_id)


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[RefusingBus]:
    bus = await RefusingBus.open(nats_url, name="test")
    assert isinstance(bus, RefusingBus)
    yield bus
    await bus.close()


async def test_a_submission_stored_while_publishing_fails_goes_out_later_once(
        bus: RefusingBus) -> None:
    seen: list[tuple[str, str]] = []
    arrived = asyncio.Event()

    async def record(msg: Msg) -> None:
        seen.append((msg.subject, type(events.decode_message(msg.data)).__name__))
        if len(seen) >= 3:
            arrived.set()

    await bus.nc.subscribe(subjects.run_state(RUN).rsplit(".", 1)[0] + ".>", cb=record)
    await bus.nc.subscribe(subjects.SCHEDULER_COMMANDS, cb=record)
    store = RunStore(bus)
    stored = runs.new_run(load_pipeline(PIPELINE), run_id=RUN, user="ada", variables={},
                          workdir="/w", now=100.0, use_cache=False)
    bus.refusing = True
    await store.create(stored)  # accepted: the run is durable, its messages are not out
    assert store.unflushed == {RUN}
    kept, _ = await store.get(RUN)
    outbox = sorted(type(o.message).__name__ for o in kept.outbox)
    assert outbox == ["EnqueueTask", "RunSubmitted", "StepStateChanged"]
    assert await store.flush_left() == 1  # still refused: kept for the next try
    bus.refusing = False
    stop = asyncio.Event()
    loop = asyncio.create_task(store.flush_loop(stop))
    try:
        await asyncio.wait_for(arrived.wait(), 10.0)
    finally:
        stop.set()
        await loop
    assert sorted(name for _, name in seen) == outbox
    after, _ = await store.get(RUN)
    assert after.outbox == ()
    assert store.unflushed == set()
    assert await store.flush_left() == 0
    await bus.nc.flush()
    assert len(seen) == 3  # published once


async def test_a_run_that_was_never_stored_is_dropped_from_the_retries(
        bus: RefusingBus) -> None:
    store = RunStore(bus)
    store.unflushed.add(RUN)  # a create whose write failed before storing anything
    assert await store.flush_left() == 0
    assert store.unflushed == set()
