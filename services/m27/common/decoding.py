"""Requests that do not parse, told to the caller as INVALID_ARGUMENT, not UNKNOWN.

gRPC parses a request with the method's deserializer before the servicer runs. Bytes that
are not the message (cut short, a wrong wire type, a string that is not UTF-8) raise
protobuf's DecodeError there, which gRPC answers with UNKNOWN ("Unexpected <class ...>")
and a traceback in the log. This interceptor does the parsing itself, in the handler: the
servicer gets the message as before, and a request that does not parse ends with
INVALID_ARGUMENT naming the RPC (found by fuzzing, issue 19).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from m27.common.admission import HEALTH_PREFIX, Context, Continuation
from m27.common.errors import InvalidRequest

Parse = Callable[[bytes], Any]


class MalformedRequest(InvalidRequest):
    """Bytes that are not the RPC's request message."""


def parsed(raw: bytes, parse: Parse, method: str) -> Any:
    """The message `raw` holds; MalformedRequest if it holds none."""
    try:
        return parse(raw)
    except (DecodeError, ValueError) as exc:
        rpc = method.rsplit("/", 1)[-1][:100]
        raise MalformedRequest(f"{rpc}: the request is not a valid protobuf message of "
                               f"this RPC ({str(exc)[:200]})") from exc


class RequestDecoding(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Parses each request in the handler, refusing malformed ones with INVALID_ARGUMENT.

    Innermost of the interceptors: the outer ones wrap the handler it returns."""

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Any:
        handler: Any = await continuation(details)
        if handler is None or handler.request_deserializer is None or \
                details.method.startswith(HEALTH_PREFIX):
            return handler
        parse, method = handler.request_deserializer, details.method
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=None,
                                    unary_unary=_unary(handler.unary_unary, parse, method))
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=None, unary_stream=_unary_stream(
                handler.unary_stream, parse, method))
        if handler.stream_unary is not None:
            return handler._replace(request_deserializer=None, stream_unary=_stream(
                handler.stream_unary, parse, method))
        if handler.stream_stream is not None:
            return handler._replace(request_deserializer=None, stream_stream=_stream_stream(
                handler.stream_stream, parse, method))
        return handler


async def _refuse(context: Context, error: MalformedRequest) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))  # short: cut above
    raise AssertionError("context.abort raises")


def _unary(behavior: Any, parse: Parse, method: str) -> Any:
    async def handle(raw: bytes, context: Context) -> Any:
        try:
            request = parsed(raw, parse, method)
        except MalformedRequest as exc:
            await _refuse(context, exc)
        return await behavior(request, context)

    return handle


def _unary_stream(behavior: Any, parse: Parse, method: str) -> Any:
    async def handle(raw: bytes, context: Context) -> AsyncIterator[Any]:
        try:
            request = parsed(raw, parse, method)
        except MalformedRequest as exc:
            await _refuse(context, exc)
        async for response in behavior(request, context):
            yield response

    return handle


async def _messages(raws: AsyncIterator[bytes], parse: Parse,
                    method: str) -> AsyncIterator[Any]:
    async for raw in raws:
        yield parsed(raw, parse, method)


def _stream(behavior: Any, parse: Parse, method: str) -> Any:
    """A client stream: each message parsed as the servicer reads it. A servicer that
    catches the MalformedRequest itself ends the call with its status (an M27Error's)."""
    async def handle(raws: AsyncIterator[bytes], context: Context) -> Any:
        try:
            return await behavior(_messages(raws, parse, method), context)
        except MalformedRequest as exc:
            await _refuse(context, exc)

    return handle


def _stream_stream(behavior: Any, parse: Parse, method: str) -> Any:
    async def handle(raws: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        try:
            async for response in behavior(_messages(raws, parse, method), context):
                yield response
        except MalformedRequest as exc:
            await _refuse(context, exc)

    return handle
