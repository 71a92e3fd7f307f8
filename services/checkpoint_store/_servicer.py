"""The gRPC edge: `m27.v1.CheckpointService` over a `CheckpointStore`.

Protobuf stops here: requests become domain values, records become `CheckpointInfo`.
Every failure leaves as one status with a clear message; an unexpected one is logged with
its traceback here and reaches the client only as INTERNAL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, NoReturn

import grpc

from m27.checkpoint_store._convert import record_to_proto
from m27.checkpoint_store._errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreError,
    CheckpointTooLarge,
    InvalidCheckpointRequest,
    StaleAttempt,
    StorageFull,
    StorageUnavailable,
)
from m27.checkpoint_store._model import Header, validate_header
from m27.checkpoint_store._store import CheckpointStore
from m27.common.grpc_server import Register
from m27.common.logging import bound_contextvars, get_logger
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

log = get_logger()

SERVICE_NAME: Final = "m27.v1.CheckpointService"

#: First match wins, so subclasses come before their bases.
STATUS_CODES: Final[tuple[tuple[type[CheckpointStoreError], grpc.StatusCode], ...]] = (
    (InvalidCheckpointRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CheckpointNotFound, grpc.StatusCode.NOT_FOUND),
    (CheckpointTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CheckpointCorrupt, grpc.StatusCode.DATA_LOSS),
    (StorageUnavailable, grpc.StatusCode.UNAVAILABLE),
    (StaleAttempt, grpc.StatusCode.FAILED_PRECONDITION),
)
INTERNAL_MESSAGE: Final = "internal error in the checkpoint-store; its log has the details"
#: A hostile task_id can be megabytes long; log lines keep only its start.
LOGGED_TASK_ID_CHARS: Final = 200

Context = grpc.aio.ServicerContext[Any, Any]


def logged(task_id: str) -> str:
    return task_id[:LOGGED_TASK_ID_CHARS]


def status_code(exc: CheckpointStoreError) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_CODES if isinstance(exc, kind)),
                grpc.StatusCode.INTERNAL)


async def _fail(context: Context, exc: Exception, rpc: str, **fields: str) -> NoReturn:
    """End the RPC with the status for `exc`; log unexpected ones with their traceback."""
    if isinstance(exc, CheckpointStoreError):
        code = status_code(exc)
        log.info("checkpoint.rejected", rpc=rpc, code=code.name, error=str(exc), **fields)
        await context.abort(code, str(exc))
    log.error("checkpoint.internal_error", rpc=rpc, error=repr(exc), exc_info=exc, **fields)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


async def read_header(requests: AsyncIterator[pb.PutRequest]) -> Header:
    """The validated header that must open a Put stream."""
    first = await anext(requests, None)
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidCheckpointRequest("a Put stream must start with the header message")
    header = first.header
    return validate_header(task_id=header.task_id, attempt=header.attempt, name=header.name,
                           metadata=dict(header.metadata))


async def data_parts(requests: AsyncIterator[pb.PutRequest]) -> AsyncIterator[bytes]:
    """The bytes of the messages after the header; a second header is an error."""
    index = 1
    async for message in requests:
        part = message.WhichOneof("part")
        if part == "header":
            raise InvalidCheckpointRequest(
                f"a Put stream carries exactly one header; message {index} is a second one")
        if part != "data":
            raise InvalidCheckpointRequest(f"Put message {index} carries neither header nor data")
        yield message.data
        index += 1


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    """The four RPCs; each puts its task_id on the log lines it writes."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest],
                  context: Context) -> pb.CheckpointInfo:
        try:
            header = await read_header(request_iterator)
            with bound_contextvars(task_id=header.task_id):
                record = await self._store.put(header, data_parts(request_iterator))
                log.info("checkpoint.stored", checkpoint_id=record.checkpoint_id,
                         size_bytes=record.size_bytes, sha256=record.sha256,
                         attempt=record.attempt)
        except Exception as exc:
            await _fail(context, exc, "Put")
        return record_to_proto(record)

    async def Get(self, request: pb.GetRequest,
                  context: Context) -> AsyncIterator[pb.GetResponse]:
        # task_id is passed, not bound: a generator's contextvars may not outlive its end.
        try:
            async with await self._store.open(request.task_id, request.checkpoint_id) as got:
                yield pb.GetResponse(info=record_to_proto(got.record))
                async for chunk in got.chunks():
                    yield pb.GetResponse(data=chunk)
        except Exception as exc:
            await _fail(context, exc, "Get", task_id=logged(request.task_id))

    async def List(self, request: pb.ListRequest, context: Context) -> pb.ListResponse:
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                records = await self._store.list(request.task_id)
            except Exception as exc:
                await _fail(context, exc, "List")
        return pb.ListResponse(checkpoints=[record_to_proto(r) for r in records])

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                deleted = await self._store.delete(request.task_id, request.checkpoint_id)
            except Exception as exc:
                await _fail(context, exc, "Delete")
            log.info("checkpoint.deleted", checkpoint_id=request.checkpoint_id,
                     existed=deleted)
        return pb.DeleteResponse(deleted=deleted)


def register(servicer: CheckpointServicer) -> Register:
    """A `Register` callback for `ServiceRuntime.serve_grpc`."""

    def add(server: grpc.aio.Server) -> None:
        pb_grpc.add_CheckpointServiceServicer_to_server(servicer, server)

    return add
