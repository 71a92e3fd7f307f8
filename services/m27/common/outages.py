"""NATS not answering, told to gRPC callers as UNAVAILABLE (retry), not UNKNOWN.

A servicer that reads or writes the bus while it is unreachable, or while a clustered
JetStream elects a stream's leader, gets a timeout or a connection error from nats-py. Left
alone, gRPC answers such an exception with UNKNOWN ("Unexpected <class ...>"), which a
client cannot tell from a bug. This interceptor turns exactly these errors into UNAVAILABLE
with a sentence naming the bus, and a message the bus refuses as too large (past its
`max_payload`, docs/security.md "Size limits") into RESOURCE_EXHAUSTED; anything else
still ends as it did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
import nats.errors
import nats.js.errors

from m27.common.admission import (
    HEALTH_PREFIX,
    Context,
    Continuation,
    Single,
    Streaming,
    wrap_handler,
)
from m27.common.logging import get_logger

log = get_logger()

#: What nats-py raises when the bus cannot answer now (the request itself may be fine).
BUS_OUTAGES: Final = (
    TimeoutError,  # nats.errors.TimeoutError and asyncio's
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.NoServersError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.js.errors.ServiceUnavailableError,
)


#: What nats-py raises for a message the bus will never take, however often it is tried.
BUS_REFUSALS: Final = (nats.errors.MaxPayloadError,)


def outage_message(error: BaseException) -> str:
    detail = (str(error).strip() or type(error).__name__)[:200]
    what = ("the message bus (NATS JetStream)" if isinstance(error, nats.errors.Error)
            else "something this call waits on")
    return f"{what} did not answer ({detail}); try again in a few seconds"


class BusOutages(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Ends a call that failed on a `BUS_OUTAGES` error with UNAVAILABLE, and on a
    `BUS_REFUSALS` one with RESOURCE_EXHAUSTED."""

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Any:
        handler: Any = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        method = details.method
        return wrap_handler(handler, lambda b: _single(b, method),
                            lambda b: _streaming(b, method))


async def _unavailable(context: Context, method: str, error: BaseException) -> None:
    log.warning("api.bus_unavailable", method=method, error=str(error) or
                type(error).__name__)
    await context.abort(grpc.StatusCode.UNAVAILABLE, outage_message(error))


async def _too_large(context: Context, method: str, error: BaseException) -> None:
    log.warning("api.bus_refused", method=method, error=str(error) or type(error).__name__)
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "what this call would store is larger than the message bus takes "
                        "in one message; send less (smaller variables, fewer steps)")


def _single(behavior: Single, method: str) -> Single:
    async def guarded(request: Any, context: Context) -> Any:
        try:
            return await behavior(request, context)
        except BUS_OUTAGES as exc:
            await _unavailable(context, method, exc)
        except BUS_REFUSALS as exc:
            await _too_large(context, method, exc)

    return guarded


def _streaming(behavior: Streaming, method: str) -> Streaming:
    async def guarded(request: Any, context: Context) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except BUS_OUTAGES as exc:
            await _unavailable(context, method, exc)
        except BUS_REFUSALS as exc:
            await _too_large(context, method, exc)

    return guarded
