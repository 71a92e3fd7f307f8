"""Status messages fit in gRPC's trailers, and requests that do not parse are refused as
INVALID_ARGUMENT (issue 19, found by fuzzing): real gRPC on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.errors import NotFoundError
from m27.common.grpc_server import MAX_STATUS_MESSAGE_BYTES, fitted, refuse, start_server

KEYS = ephemeral_keys()
ADMIN = ApiAccess(token=KEYS.mint(user="tester", role="admin", ttl_s=0))
Request = health_pb2.HealthCheckRequest


def sent_size(message: str) -> int:
    """Bytes of `message` percent-encoded as gRPC sends it."""
    return sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in message)


@pytest.mark.parametrize(("message", "kept"), [
    ("no node 'x' is registered", True),
    ("a" * (MAX_STATUS_MESSAGE_BYTES - 100), True),
    ("a" * 70_000, False),
    ("é" * 70_000, False),
    ("\U0001f600" * 5000, False),
    ("%" * 5000, False),
])
def test_a_status_message_is_cut_to_fit_and_says_so(message: str, kept: bool) -> None:
    cut = fitted(message)
    assert (cut == message) is kept
    assert sent_size(cut) <= MAX_STATUS_MESSAGE_BYTES
    if not kept:
        assert cut.endswith("more characters)")


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    async def echo(request: Any, context: Any) -> Any:
        await refuse(context, NotFoundError(f"no service {request.service!r}"))

    async def count(requests: AsyncIterator[Any], context: Any) -> Any:
        seen = [r async for r in requests]
        return health_pb2.HealthCheckResponse(status=len(seen))

    handlers = grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(
            echo, Request.FromString, health_pb2.HealthCheckResponse.SerializeToString),
        "Count": grpc.stream_unary_rpc_method_handler(
            count, Request.FromString, health_pb2.HealthCheckResponse.SerializeToString)})
    server = await start_server("127.0.0.1:0", [lambda s: s.add_generic_rpc_handlers(
        (handlers,))], [], keys=KEYS, method_roles={
            "/test.Echo/Echo": frozenset({"admin"}), "/test.Echo/Count": frozenset({"admin"})})
    await server.serving()
    async with ADMIN.channel(server.address) as opened:
        yield opened
    await server.stop(0)


async def test_a_refusal_that_echoes_a_huge_input_still_reaches_the_caller(
        channel: grpc.aio.Channel) -> None:
    """Used to end RESOURCE_EXHAUSTED "Stream removed" on the client (its 16 KiB limit on
    metadata), hiding the real status."""
    call = channel.unary_unary("/test.Echo/Echo", Request.SerializeToString, None)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(Request(service="x" * 100_000), timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert (caught.value.details() or "").startswith("no service 'xxx")


@pytest.mark.parametrize("raw", [b"\x00", b"\x0a\x05ab", b"\x0a\x02\xff\xfe"])
async def test_bytes_that_are_not_the_message_are_invalid_argument(
        channel: grpc.aio.Channel, raw: bytes) -> None:
    for method, send in (("Echo", raw), ("Count", iter([Request().SerializeToString(), raw]))):
        call: Any = (channel.unary_unary if method == "Echo" else channel.stream_unary)(
            f"/test.Echo/{method}", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(send, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "not a valid protobuf message" in (caught.value.details() or "")
