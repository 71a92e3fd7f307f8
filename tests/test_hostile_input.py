"""Hostile input, each test written as the attack (issue 14, point 3): a real system on
loopback, and again with mutual TLS on its API, raw gRPC calls a client library would
never send, and messages no service would publish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.model import Resources
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc
from tests.support import Cluster

pytestmark = pytest.mark.integration

if TYPE_CHECKING:
    Stub = pb_grpc.PipelineServiceAsyncStub


@pytest.fixture(scope="module", params=["loopback", "tls"])
def cluster(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    system = Cluster(tmp_path_factory.mktemp("hostile"), api_tls=request.param == "tls")
    system.start()
    yield system
    system.stop()


@pytest.fixture
async def stub(cluster: Cluster) -> AsyncIterator[Stub]:
    async with cluster.access.channel(cluster.api) as channel:
        yield pb_grpc.PipelineServiceStub(channel)


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def axes(count: int, values: int) -> str:
    return ", ".join(f"a{n}: [{', '.join(str(i) for i in range(values))}]"
                     for n in range(count))


async def test_enums_and_numbers_out_of_their_range_are_refused_not_unknown(
        stub: Stub) -> None:
    unknown_state: Any = 999
    assert await code_of(stub.ListRuns(pb.ListRunsRequest(states=[unknown_state]))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    watch = stub.WatchRun(pb.WatchRunRequest(run_id="r-20261201-000000-abcdef",
                                             after_sequence=2**64 - 1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await anext(aiter(watch))
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    unknown_urgency: Any = 77
    assert await code_of(stub.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml="pipeline:\n  - {name: a, command: echo}\n",
        urgency=unknown_urgency))) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
async def test_sweep_and_fan_in_bombs_are_refused_at_once_and_the_api_keeps_answering(
        stub: Stub) -> None:
    """Documents of a few KB that used to take the orchestrator down (10^8 steps, OOM;
    8·10^6 steps, 40 s of a blocked event loop; 10^6, UNKNOWN)."""
    bombs = [f"pipeline:\n  - name: t\n    matrix: {{{axes(4, 100)}}}\n    command: echo\n",
             f"pipeline:\n  - name: t\n    matrix: {{{axes(3, 200)}}}\n    command: echo\n",
             f"pipeline:\n  - name: t\n    matrix: {{{axes(2, 1000)}}}\n    command: echo\n",
             "pipeline:\n  - name: s\n    matrix: {" + axes(1, 1000) + "}\n    command: e\n"
             + "".join(f"  - {{name: g{i}, depends_on: [s], command: e}}\n"
                       for i in range(500))]
    began = time.monotonic()
    for bomb in bombs:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SubmitPipeline(pb.SubmitPipelineRequest(pipeline_yaml=bomb))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than" in (caught.value.details() or "")
        assert len(caught.value.details() or "") < 2000
    assert time.monotonic() - began < 20
    # and meanwhile a cheap call is answered: parsing is off the event loop
    flood = [asyncio.ensure_future(stub.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=bombs[3]))) for _ in range(8)]
    quick = time.monotonic()
    listed = await stub.ListRuns(pb.ListRunsRequest(limit=1))
    assert time.monotonic() - quick < 5
    assert listed is not None
    results = await asyncio.gather(*flood, return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError)
               and r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in results)


@pytest.mark.timeout(120)
async def test_a_burst_of_calls_is_answered_or_refused_clearly_never_cancelled(
        stub: Stub) -> None:
    """2,000 concurrent calls: each gets an answer or RESOURCE_EXHAUSTED (the server's
    concurrent-call limit), never a bare CANCELLED or UNKNOWN."""
    calls = [code_of(stub.ListRuns(pb.ListRunsRequest(limit=1), timeout=90))
             for _ in range(2000)]
    codes = await asyncio.gather(*calls)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.OK) > 0


@pytest.mark.timeout(120)
async def test_a_task_id_that_climbs_out_of_its_keys_is_dead_lettered_once(
        cluster: Cluster, stub: Stub) -> None:
    """Used to be retried by the scheduler once a second forever, a traceback each time."""
    bus = await NatsBus.open(cluster.nats_url, name="attacker")
    try:
        dead = await bus.js.subscribe(subjects.dead_letter(subjects.SCHEDULER_COMMAND_CONSUMER),
                                      ordered_consumer=True)
        hostile = "r-20261201-000000-abcdef/../../x"
        await bus.publish(subjects.SCHEDULER_COMMANDS, events.EnqueueTask(
            at=time.time(), task_id=hostile, run_id="r-20261201-000000-abcdef", step="x",
            attempt=1, step_type="cpu", resources=Resources(cpus=1), urgency="normal",
            user="mallory", command="true"))
        letter = await dead.next_msg(timeout=60)
        assert letter.headers is not None
        assert letter.headers["M27-Error"] == f"not a task id: {hostile!r}"
        await dead.unsubscribe()
        # the scheduler goes on: a real run still gets scheduled and finishes
        reply = await stub.SubmitPipeline(pb.SubmitPipelineRequest(
            pipeline_yaml="pipeline:\n  - {name: ok, command: 'true'}\n"))
        watch = stub.WatchRun(pb.WatchRunRequest(run_id=reply.run_id))
        async for item in watch:
            if item.HasField("event") and item.event.type == "run_state_changed" and \
                    item.event.state in ("succeeded", "failed", "cancelled"):
                assert item.event.state == "succeeded"
                break
        consumer = await bus.js.consumer_info(subjects.COMMANDS_STREAM,
                                              subjects.SCHEDULER_COMMAND_CONSUMER)
        assert consumer.num_ack_pending == 0  # nothing left coming back
    finally:
        await bus.close()
