"""A call that meets NATS not answering ends UNAVAILABLE with a sentence, not UNKNOWN; other
failures end as before (real gRPC on loopback)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import nats.errors
import nats.js.errors
import pytest

from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.grpc_server import start_server

KEYS = ephemeral_keys()
ADMIN = ApiAccess(token=KEYS.mint(user="tester", role="admin", ttl_s=0))
FAILURES: dict[str, Exception] = {
    "timeout": nats.errors.TimeoutError(),
    "closed": nats.errors.ConnectionClosedError(),
    "reconnecting": nats.errors.ConnectionReconnectingError(),
    "no_responders": nats.errors.NoRespondersError(),
    "election": nats.js.errors.ServiceUnavailableError(description="JetStream system "
                                                                   "temporarily unavailable"),
}


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    async def fail(request: bytes, context: object) -> bytes:
        failure = request.decode()
        if failure == "bug":
            raise ValueError("a bug of ours")
        if failure == "too_large":
            raise nats.errors.MaxPayloadError
        raise FAILURES[failure]

    async def stream(request: bytes, context: object) -> AsyncIterator[bytes]:
        yield b"first"
        raise FAILURES[request.decode()]

    handlers = grpc.method_handlers_generic_handler("test.Bus", {
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = await start_server("127.0.0.1:0", [lambda s: s.add_generic_rpc_handlers(
        (handlers,))], [], keys=KEYS, method_roles={
            "/test.Bus/Fail": frozenset({"admin"}), "/test.Bus/Stream": frozenset({"admin"})})
    await server.serving()
    async with ADMIN.channel(server.address) as opened:
        yield opened
    await server.stop(0)


@pytest.mark.parametrize("failure", sorted(FAILURES))
async def test_a_bus_outage_is_unavailable_with_a_sentence(channel: grpc.aio.Channel,
                                                           failure: str) -> None:
    call = channel.unary_unary("/test.Bus/Fail", None, None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(failure.encode(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    details = caught.value.details() or ""
    assert details.startswith("the message bus (NATS JetStream) did not answer (")
    assert details.endswith("); try again in a few seconds")


async def test_a_stream_that_meets_an_outage_ends_unavailable_after_what_it_sent(
        channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream("/test.Bus/Stream", None, None)
    got: list[bytes] = []

    async def read() -> None:
        async for part in call(b"election", timeout=30):
            got.append(part)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read()
    assert got == [b"first"]
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_other_failures_are_not_called_outages(channel: grpc.aio.Channel) -> None:
    call = channel.unary_unary("/test.Bus/Fail", None, None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(b"bug", timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN


async def test_a_message_the_bus_will_never_take_is_resource_exhausted(
        channel: grpc.aio.Channel) -> None:
    """Past NATS's max_payload: retrying cannot help, so not UNAVAILABLE; used to be UNKNOWN
    (found by fuzzing SubmitPipeline with 10 MB of variables)."""
    call = channel.unary_unary("/test.Bus/Fail", None, None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(b"too_large", timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than the message bus takes" in (caught.value.details() or "")
