"""A report copy's reader (`report.replica.follow`) on a real NATS: every message once, in
order, from the stored position; a refused one passed, a failing one tried again; stopped
and started again, it reads on from where its store is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from m27.common import bus as bus_module
from m27.common import subjects
from m27.common.bus import NatsBus
from m27.report.replica import Progress, Source, follow
from m27.report.store import Applied, History

SOURCE = Source("test", subjects.EVENTS_STREAM, ("m27.events.run.r-test.>",))


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[NatsBus]:
    bus = await NatsBus.open(nats_url, name="test")
    yield bus
    await bus.close()


class Recorder:
    """Marks what it applies with its position, as the history writers do; `b'poison'` is
    refused, `b'flaky'` fails once (NATS away), `b'noop'` has no effect."""

    def __init__(self, history: History, want: int) -> None:
        self.history = history
        self.seen: list[bytes] = []
        self.failed = False
        self.want = want
        self.done = asyncio.Event()

    async def handle(self, msg: Msg, applied: Applied) -> bool:
        if msg.data == b"flaky" and not self.failed:
            self.failed = True
            raise TimeoutError("nats: timeout")
        self.seen.append(msg.data)
        if len(self.seen) >= self.want:
            self.done.set()
        if msg.data == b"poison":
            raise bus_module.PoisonMessage("refused: not what it claims")
        if msg.data == b"noop":
            return False
        await asyncio.to_thread(self.history.mark, applied)
        return True


async def publish(bus: NatsBus, *bodies: bytes) -> list[int]:
    return [(await bus.js.publish("m27.events.run.r-test.state", body)).seq
            for body in bodies]


async def run_until_done(bus: NatsBus, history: History, recorder: Recorder) -> None:
    stop = asyncio.Event()
    reader = asyncio.create_task(follow(bus.js, history, SOURCE, recorder.handle, stop,
                                        Progress()))
    try:
        await asyncio.wait_for(recorder.done.wait(), 30)
        await asyncio.sleep(0)  # let the reader go idle and store what it passed
    finally:
        stop.set()
        await asyncio.wait_for(reader, 10)


async def test_each_message_once_from_the_stored_position(bus: NatsBus,
                                                          tmp_path: Path) -> None:
    history = History(tmp_path / "history.sqlite")
    try:
        await publish(bus, b"one", b"noop", b"flaky", b"poison", b"two")
        first = Recorder(history, want=5)
        await run_until_done(bus, history, first)
        assert first.seen == [b"one", b"noop", b"flaky", b"poison", b"two"]
        assert first.failed  # tried again, not passed
        seqs = await publish(bus, b"noop", b"three")
        second = Recorder(history, want=2)
        await run_until_done(bus, history, second)
        assert second.seen == [b"noop", b"three"]  # nothing of before read again
        assert history.position(SOURCE.name) == seqs[-1] + 1
    finally:
        history.close()


async def test_a_position_beyond_a_stream_that_was_made_anew_reads_it_from_its_start(
        bus: NatsBus, tmp_path: Path) -> None:
    """A copy whose store outlived the bus's (NATS rebuilt, `m27 bus setup` on an empty
    cluster): its stored position lies past the stream's end. It reads the stream from its
    start, and stores the new positions."""
    history = History(tmp_path / "history.sqlite")
    try:
        history.mark((SOURCE.name, 1_000_000))
        seqs = await publish(bus, b"one", b"two")
        recorder = Recorder(history, want=2)
        await run_until_done(bus, history, recorder)
        assert recorder.seen == [b"one", b"two"]
        assert history.position(SOURCE.name) == seqs[-1] + 1
    finally:
        history.close()
