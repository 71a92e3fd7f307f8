"""Admission: a full server refuses the next call with RESOURCE_EXHAUSTED at once, lets
health checks through, and admits again once calls end (real gRPC on loopback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.grpc_server import start_server

KEYS = ephemeral_keys()
ADMIN = ApiAccess(token=KEYS.mint(user="tester", role="admin", ttl_s=0))
SERVICE = ApiAccess(token=KEYS.mint(user="report", role="service", ttl_s=0))



async def test_a_full_server_refuses_clearly_and_admits_again() -> None:
    release, full = asyncio.Event(), asyncio.Event()
    entered: list[int] = []

    async def wait(request: bytes, context: object) -> bytes:
        entered.append(1)
        if len(entered) == 3:
            full.set()
        await release.wait()
        return request

    async def chunks(request: bytes, context: object):  # type: ignore[no-untyped-def]
        for part in (b"a", b"b"):
            yield part

    handlers = grpc.method_handlers_generic_handler("test.Slow", {
        "Wait": grpc.unary_unary_rpc_method_handler(wait),
        "Chunks": grpc.unary_stream_rpc_method_handler(chunks)})
    server = await start_server("127.0.0.1:0", [lambda s: s.add_generic_rpc_handlers(
        (handlers,))], [], keys=KEYS, max_calls=3, method_roles={
            "/test.Slow/Wait": frozenset({"admin"}), "/test.Slow/Chunks": frozenset({"admin"})})
    await server.serving()
    async with ADMIN.channel(server.address) as channel:
        call = channel.unary_unary("/test.Slow/Wait", None, None)
        held = [asyncio.ensure_future(call(b"x", timeout=30)) for _ in range(3)]
        await asyncio.wait_for(full.wait(), 30)
        codes = []
        for _ in range(5):
            try:
                await call(b"y", timeout=30)
            except grpc.aio.AioRpcError as error:
                codes.append((error.code(), error.details()))
        assert codes == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is handling 3 calls "
                          "already; retry in a moment")] * 5
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes still pass
        release.set()
        assert await asyncio.gather(*held) == [b"x"] * 3
        assert await call(b"z", timeout=30) == b"z"  # room again
        stream = channel.unary_stream("/test.Slow/Chunks", None, None)
        assert [part async for part in stream(b"", timeout=30)] == [b"a", b"b"]
    await server.stop(0)


async def test_a_flood_of_users_calls_leaves_room_for_the_systems_own() -> None:
    """Found by the load bench: 5,000 users' submissions at once, and the report's own
    calls to the orchestrator were refused too. A tenth of the limit is kept for services
    and node-agents."""
    release, entered = asyncio.Event(), asyncio.Queue[int]()

    async def wait(request: bytes, context: object) -> bytes:
        entered.put_nowait(1)
        await release.wait()
        return request

    handlers = grpc.method_handlers_generic_handler("test.Slow", {
        "Wait": grpc.unary_unary_rpc_method_handler(wait)})
    server = await start_server("127.0.0.1:0", [lambda s: s.add_generic_rpc_handlers(
        (handlers,))], [], keys=KEYS, max_calls=10, method_roles={
            "/test.Slow/Wait": frozenset({"admin", "service"})})
    await server.serving()
    async with ADMIN.channel(server.address) as people, \
            SERVICE.channel(server.address) as system:
        by_people = people.unary_unary("/test.Slow/Wait", None, None)
        by_system = system.unary_unary("/test.Slow/Wait", None, None)
        held = [asyncio.ensure_future(by_people(b"u", timeout=30)) for _ in range(9)]
        for _ in range(9):
            await asyncio.wait_for(entered.get(), 30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a tenth call of users
            await by_people(b"u", timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.append(asyncio.ensure_future(by_system(b"s", timeout=30)))  # the reserve
        await asyncio.wait_for(entered.get(), 30)
        with pytest.raises(grpc.aio.AioRpcError) as full:  # an eleventh call
            await by_system(b"s", timeout=30)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert await asyncio.gather(*held) == [b"u"] * 9 + [b"s"]
    await server.stop(0)
