"""Admission of gRPC calls: at most `limit` calls inside a server at once; the next ones are
refused at once with RESOURCE_EXHAUSTED, a status a client can act on (back off, retry).

gRPC core queues calls the application has not taken yet and, past its pending-request
limit, cancels them with a bare CANCELLED — which is what a flood of 5,000 calls got. The
servers raise that queue's limits (`grpc_server.SERVER_OPTIONS`) so that every call reaches
this interceptor, which decides. Health checks are always admitted: probes must see a
server that is busy, not one that seems dead. A tenth of the calls is kept for the
system's own callers (services, node-agents): a flood of users' calls is refused before it
fills the server, so the report's and the agents' calls still get in (found by the load
bench: during 5,000 concurrent submissions the report's calls were refused too). It runs
after `api_auth.Authenticator`, which says who calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import grpc

from m27.common.api_auth import caller
from m27.common.errors import Unauthenticated

HEALTH_PREFIX: Final = "/grpc.health.v1.Health/"
#: Roles of the system's own callers, who may use the share of the calls users may not.
SYSTEM_ROLES: Final = frozenset({"service", "node"})

Context = grpc.aio.ServicerContext[Any, Any]
#: gRPC's stubs type handlers as the sync API's; in the aio server they are coroutines.
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Any]]


Single = Callable[[Any, Context], Awaitable[Any]]
Streaming = Callable[[Any, Context], AsyncIterator[Any]]


def wrap_handler(handler: Any, single: Callable[[Single], Single],
                 streaming: Callable[[Streaming], Streaming]) -> Any:
    """`handler` (an RpcMethodHandler) with its behaviour wrapped: `single` for calls with
    one response, `streaming` for calls that stream their responses."""
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=single(handler.unary_unary))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=single(handler.stream_unary))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=streaming(handler.unary_stream))
    if handler.stream_stream is not None:
        return handler._replace(stream_stream=streaming(handler.stream_stream))
    return handler


class Admission(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts the calls in progress (streams until they end) and refuses beyond `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.user_limit = limit - limit // 10  # the rest is kept for SYSTEM_ROLES
        self.active = 0
        self.refused = 0

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Any:
        handler: Any = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        return wrap_handler(handler, self._single, self._streaming)

    async def _admit(self, context: Context) -> None:
        if self.active >= (self.limit if _from_the_system() else self.user_limit):
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server is handling {self.active} calls already; retry "
                                "in a moment")
        self.active += 1

    def _single(self, behavior: Single) -> Single:
        async def admitted(request: Any, context: Context) -> Any:
            await self._admit(context)
            try:
                return await behavior(request, context)
            finally:
                self.active -= 1

        return admitted

    def _streaming(self, behavior: Streaming) -> Streaming:
        async def admitted(request: Any, context: Context) -> AsyncIterator[Any]:
            await self._admit(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self.active -= 1

        return admitted


def _from_the_system() -> bool:
    try:
        return caller().role in SYSTEM_ROLES
    except Unauthenticated:  # a call that needs no token (none does but health checks)
        return False
