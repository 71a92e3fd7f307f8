"""The shared JetStream plumbing against a real nats-server."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from m27.common import events, subjects
from m27.common.bus import (
    MAX_FAILED_DELIVERIES,
    Bus,
    NatsBus,
    PoisonMessage,
    consume,
    until_settled,
)
from m27.common.errors import Unavailable
from m27.common.memory_bus import MemoryBus
from m27.common.model import ServiceInfo

pytestmark = pytest.mark.integration


def info(name: str) -> ServiceInfo:
    return ServiceInfo(name=name, instance="i", grpc_address="127.0.0.1:1", pid=1, host="h",
                       started_at=1.0)


async def test_topology_is_idempotent_and_keys_are_listed_by_pattern(nats_url: str) -> None:
    first, second = await asyncio.gather(NatsBus.open(nats_url, name="a"),
                                         NatsBus.open(nats_url, name="b"))
    try:
        assert await first.kv_keys(subjects.SERVICES_BUCKET) == []
        for key in ("r1.a.x", "r1.a.y", "r1.b.x", "r2.a.x"):
            await first.kv_put(subjects.SERVICES_BUCKET, key, info(key))
        assert await second.kv_keys(subjects.SERVICES_BUCKET, "r1.a.*") == ["r1.a.x", "r1.a.y"]
        assert await second.kv_keys(subjects.SERVICES_BUCKET, "*.a.x") == ["r1.a.x", "r2.a.x"]
        await first.kv_delete(subjects.SERVICES_BUCKET, "r1.a.x")
        assert await second.kv_get(subjects.SERVICES_BUCKET, "r1.a.x", ServiceInfo) is None
        got = await second.kv_get(subjects.SERVICES_BUCKET, "r1.a.y", ServiceInfo)
        assert got is not None
        assert got[0] == info("r1.a.y")
    finally:
        await first.close()
        await second.close()


async def _subject_count(bus: NatsBus, bucket: str) -> int:
    """How many keys the bucket's stream holds a message for (values and markers)."""
    return (await bus.js.stream_info(f"KV_{bucket}")).state.messages


async def _until_gone(bus: NatsBus, bucket: str, expected: int) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while await _subject_count(bus, bucket) != expected:
        assert asyncio.get_running_loop().time() < deadline, "the server kept the entries"
        await asyncio.sleep(0.2)


async def test_a_deleted_key_and_a_value_written_with_a_ttl_leave_the_bucket(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in the soak: nats-server grew with every key ever deleted (each finished
    task's marker) and every fence. A delete's marker and a value written with `ttl_s`
    are removed by the server itself; a compare-and-set delete loses to a newer write."""
    from m27.common import bus as module
    from m27.common.model import Fence

    monkeypatch.setattr(module, "DELETE_MARKER_TTL_S", 1.0)
    bus = await NatsBus.open(nats_url, name="ttl")
    try:
        await bus.kv_put(subjects.SERVICES_BUCKET, "gone", info("gone"))
        await bus.kv_put(subjects.SERVICES_BUCKET, "kept", info("kept"))
        await bus.kv_delete(subjects.SERVICES_BUCKET, "gone")
        assert await bus.kv_get(subjects.SERVICES_BUCKET, "gone", ServiceInfo) is None
        await _until_gone(bus, subjects.SERVICES_BUCKET, 1)  # the marker expired
        assert await bus.kv_keys(subjects.SERVICES_BUCKET) == ["kept"]
        await bus.kv_put(subjects.SERVICES_BUCKET, "gone", info("back"))  # a key again
        assert await bus.kv_get(subjects.SERVICES_BUCKET, "gone", ServiceInfo) is not None

        fence = Fence(task_id="r/a", attempt=1, node_id="n", at=1.0)
        await bus.kv_update(subjects.FENCES_BUCKET, "r.a", Fence, lambda _: fence)
        await bus.kv_update(subjects.FENCES_BUCKET, "r.a", Fence, lambda f: f, ttl_s=1.0)
        await bus.kv_update(subjects.FENCES_BUCKET, "r.b", Fence, lambda _: fence, ttl_s=1.0)
        await bus.kv_update(subjects.FENCES_BUCKET, "r.c", Fence, lambda _: fence)
        got = await bus.kv_get(subjects.FENCES_BUCKET, "r.a", Fence)
        assert got is not None
        assert got[0] == fence  # until it expires
        await _until_gone(bus, subjects.FENCES_BUCKET, 1)
        assert await bus.kv_keys(subjects.FENCES_BUCKET) == ["r.c"]

        stale = await bus.kv_get(subjects.FENCES_BUCKET, "r.c", Fence)
        assert stale is not None
        await bus.kv_update(subjects.FENCES_BUCKET, "r.c", Fence, lambda f: fence)
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await bus.kv_delete(subjects.FENCES_BUCKET, "r.c", last=stale[1])
        assert await bus.kv_get(subjects.FENCES_BUCKET, "r.c", Fence) is not None
    finally:
        await bus.close()


async def test_a_bucket_made_without_message_ttls_still_deletes_and_updates(
        nats_url: str) -> None:
    """A bucket an older m27 (or an operator) made without `allow_msg_ttl`: deletes and
    TTL'd writes work as plain ones (the entries stay), with a warning."""
    from nats.js.api import StreamConfig

    bus = await NatsBus.open(nats_url, name="old")
    try:
        await bus.js.add_stream(StreamConfig(name="KV_old", subjects=["$KV.old.>"],
                                             allow_rollup_hdrs=True, max_msgs_per_subject=1))
        await bus.kv_put("old", "a", info("a"))
        with capture_logs() as logs:
            await bus.kv_update("old", "a", ServiceInfo, lambda _: info("b"), ttl_s=1.0)
            await bus.kv_delete("old", "a")
        assert await bus.kv_get("old", "a", ServiceInfo) is None
        assert [e["event"] for e in logs] == ["nats.kv_ttl_disabled"]  # once per bucket
    finally:
        await bus.close()


async def test_consume_acks_after_success_retries_failures_and_drops_poison(
        nats_url: str) -> None:
    bus = await NatsBus.open(nats_url, name="test")
    seen: list[str] = []
    failed_once: set[str] = set()
    stop = asyncio.Event()

    async def handle(msg: Msg) -> None:
        if msg.data == b"not json":
            raise PoisonMessage("undecodable")
        event = events.decode_event(msg.data)
        assert isinstance(event, events.NodeStopped)
        if event.node_id == "flaky" and "flaky" not in failed_once:
            failed_once.add("flaky")
            raise RuntimeError("transient")
        seen.append(event.node_id)
        if len(seen) == 2:
            stop.set()

    await bus.publish(subjects.node_events("flaky"), events.NodeStopped(at=1, node_id="flaky"))
    await bus.js.publish(subjects.node_events("junk"), b"not json")
    await bus.publish(subjects.node_events("fine"), events.NodeStopped(at=2, node_id="fine"))
    await asyncio.wait_for(consume(bus.js, stream=subjects.EVENTS_STREAM, durable="t",
                                   filter_subject=subjects.NODE_EVENTS_ALL, handle=handle,
                                   stop=stop), timeout=20)
    assert sorted(seen) == ["fine", "flaky"]
    for _ in range(50):  # acks are fire-and-forget: give the last one a moment to land
        consumer = await bus.js.consumer_info(subjects.EVENTS_STREAM, "t")
        if consumer.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert consumer.num_ack_pending == 0
    assert consumer.num_pending == 0
    await bus.close()


async def test_a_message_id_is_stored_once(nats_url: str) -> None:
    bus = await NatsBus.open(nats_url, name="test")
    event = events.NodeStopped(at=1, node_id="n")
    for _ in range(3):
        await bus.publish(subjects.node_events("n"), event, msg_id="same")
    stream = await bus.js.stream_info(subjects.EVENTS_STREAM)
    assert stream.state.messages == 1
    await bus.close()


async def bus_script(bus: Bus) -> list[object]:
    """What a service core does with a bus, with everything observable written down."""
    seen: list[object] = []
    bucket = subjects.SERVICES_BUCKET
    for key in ("n1.a", "n1.b", "n2.a", "n2.b.c"):
        await bus.kv_put(bucket, key, info(key))
    seen.append(await bus.kv_keys(bucket))
    for pattern in ("n1.*", "*.a", "n2.>", ">", "n3.*", "n2.b"):
        seen.append((pattern, await bus.kv_keys(bucket, pattern)))
    got = await bus.kv_get(bucket, "n1.a", ServiceInfo)
    seen.append(None if got is None else got[0])
    seen.append(await bus.kv_get(bucket, "missing", ServiceInfo))

    def bump(current: ServiceInfo | None) -> ServiceInfo | None:
        base = current or info("fresh")
        return msgspec.structs.replace(base, pid=base.pid + 1)

    updated: list[ServiceInfo | None] = [
        await bus.kv_update(bucket, "n1.a", ServiceInfo, bump),
        await bus.kv_update(bucket, "new", ServiceInfo, bump),  # created
        await bus.kv_update(bucket, "new", ServiceInfo, lambda _: None)]  # left alone
    seen.extend(updated)
    await bus.kv_delete(bucket, "n1.b")
    await bus.kv_delete(bucket, "never-there")
    seen.append(await bus.kv_get(bucket, "n1.b", ServiceInfo))
    seen.append([key for key in await bus.kv_keys(bucket, "n1.*")
                 if await bus.kv_get(bucket, key, ServiceInfo) is not None])
    return seen


async def test_the_in_memory_bus_answers_as_a_real_one_does(nats_url: str) -> None:
    """MemoryBus is the only fake of the bus in unit tests: the same script gives the same
    answers on it as on a real JetStream (a deleted key may still be listed by NATS, so
    keys are compared after kv_get says they exist)."""
    real = await NatsBus.open(nats_url, name="contract")
    try:
        on_nats = await bus_script(real)
    finally:
        await real.close()
    assert await bus_script(MemoryBus()) == on_nats


async def test_the_in_memory_bus_records_publishes_and_fails_on_demand() -> None:
    bus = MemoryBus()
    stopped = events.NodeStopped(at=1, node_id="n1")
    await bus.publish(subjects.node_events("n1"), stopped, msg_id="m1")
    await bus.publish_core(subjects.node_events("n1"), stopped)
    assert bus.kinds() == ["node_stopped"]
    assert bus.of(events.NodeStopped) == [stopped]
    assert bus.core == [(subjects.node_events("n1"), stopped)]
    bus.fail_with = TimeoutError("nats: timeout")
    with pytest.raises(TimeoutError):
        await bus.publish(subjects.node_events("n1"), stopped)
    with pytest.raises(TimeoutError):
        await bus.kv_keys(subjects.SERVICES_BUCKET)
    assert len(bus.published) == 1


async def dead_letters(bus: NatsBus, count: int) -> list[Msg]:
    """The first `count` dead letters, waiting for them (a fact, not a time)."""
    sub = await bus.js.subscribe(subjects.DEAD_ALL, ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=20) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def test_poison_and_hopeless_messages_are_dead_lettered_transient_ones_retried(
        nats_url: str) -> None:
    """Undecodable: dead-lettered at once. Failing for a reason that will not change (a
    bug, bad data): MAX_FAILED_DELIVERIES tries, then dead-lettered. Failing because
    something is away (Unavailable, NATS, a timeout): retried until it works."""
    bus = await NatsBus.open(nats_url, name="test")
    tries: dict[str, int] = {}
    handled = asyncio.Event()
    stop = asyncio.Event()

    async def handle(msg: Msg) -> None:
        if msg.data == b"not json":
            raise PoisonMessage("undecodable")
        event = events.decode_event(msg.data)
        assert isinstance(event, events.NodeStopped)
        tries[event.node_id] = tries.get(event.node_id, 0) + 1
        if event.node_id == "buggy":
            raise KeyError("a bug that every delivery meets")
        if event.node_id == "away" and tries["away"] <= MAX_FAILED_DELIVERIES + 2:
            raise Unavailable("the orchestrator is not there yet")
        handled.set()

    await bus.js.publish(subjects.node_events("junk"), b"not json")
    await bus.publish(subjects.node_events("buggy"), events.NodeStopped(at=1, node_id="buggy"))
    await bus.publish(subjects.node_events("away"), events.NodeStopped(at=2, node_id="away"))
    consumer = asyncio.create_task(consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable="dl", filter_subject=
        subjects.NODE_EVENTS_ALL, handle=handle, stop=stop, retry_s=0.05))
    try:
        junk, buggy = await dead_letters(bus, 2)
        await asyncio.wait_for(handled.wait(), 20)
    finally:
        stop.set()
        await consumer
    assert junk.data == b"not json"
    assert junk.subject == subjects.dead_letter("dl")
    assert junk.headers is not None
    assert junk.headers["M27-Original-Subject"] == subjects.node_events("junk")
    assert junk.headers["M27-Error"] == "undecodable"
    assert buggy.headers is not None
    assert buggy.headers["M27-Error"] == "KeyError: 'a bug that every delivery meets'"
    assert tries["buggy"] == MAX_FAILED_DELIVERIES
    assert tries["away"] == MAX_FAILED_DELIVERIES + 3  # never given up on: it worked
    stream = await bus.js.stream_info(subjects.DEAD_STREAM)
    assert stream.state.messages == 2
    await bus.close()


async def test_until_settled_asks_again_until_the_bus_answers(nats_url: str) -> None:
    """What a service cannot start without is asked for again while nobody answers (a
    fresh or healing cluster), and answered once someone does — on a real server."""
    bus = await NatsBus.open(nats_url, name="settle")
    stop = asyncio.Event()
    attempts: list[float] = []

    async def ask() -> bytes:
        attempts.append(asyncio.get_running_loop().time())
        return await bus.request("m27.test.settle", b"?", timeout=1)

    async def answer(msg: Msg) -> None:
        await msg.respond(b"!")

    try:
        with capture_logs() as logs:
            asking = asyncio.create_task(until_settled(ask, what="a test answer", stop=stop,
                                                       first_s=0.05, max_s=0.2))
            while len(attempts) < 3:  # refused twice at least: no responders
                assert not asking.done(), asking
                await asyncio.sleep(0.01)
            await bus.nc.subscribe("m27.test.settle", cb=answer)
            assert await asyncio.wait_for(asking, 10) == b"!"
        waits = [b - a for a, b in itertools.pairwise(attempts)]
        assert all(w >= 0.04 for w in waits), waits  # it waited between tries
        assert all(w <= 1.0 for w in waits), waits  # at most max_s (plus the loop's lag)
        warned = [e for e in logs if e["event"] == "bus.not_settled"]
        assert len(warned) >= 2
        assert {e["what"] for e in warned} == {"a test answer"}
    finally:
        await bus.close()


async def test_until_settled_raises_a_refusal_at_once_and_any_error_after_stop(
        nats_url: str) -> None:
    """A refusal (here: a bucket that does not exist) is not waited out; nor is an
    unanswered request once the service is stopping."""
    bus = await NatsBus.open(nats_url, name="settle")
    stop = asyncio.Event()
    calls: list[str] = []

    async def put() -> int:
        calls.append("put")
        return await bus.kv_put("no_such_bucket", "k", info("x"))

    async def ask() -> bytes:
        calls.append("ask")
        return await bus.request("m27.test.nobody", b"?", timeout=1)

    try:
        with pytest.raises(nats.js.errors.Error):
            await until_settled(put, what="a put", stop=stop, first_s=0.01)
        assert calls == ["put"]
        stop.set()
        with pytest.raises(nats.errors.NoRespondersError):
            await until_settled(ask, what="an answer", stop=stop, first_s=0.01)
        assert calls == ["put", "ask"]
    finally:
        await bus.close()


async def test_until_settled_ends_when_cancelled_while_it_waits(nats_url: str) -> None:
    """A copy stepping down cancels what it was starting: the wait between tries ends at
    once, however long it was."""
    bus = await NatsBus.open(nats_url, name="settle")
    tried = asyncio.Event()

    async def ask() -> bytes:
        tried.set()
        return await bus.request("m27.test.nobody", b"?", timeout=1)

    try:
        asking = asyncio.create_task(until_settled(ask, what="an answer", stop=asyncio.Event(),
                                                   first_s=60, max_s=60))
        await asyncio.wait_for(tried.wait(), 10)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asking, 5)
    finally:
        await bus.close()
