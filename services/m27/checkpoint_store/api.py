"""The gRPC edge: `m27.v1.CheckpointService` over a `CheckpointStore`.

Protobuf stops here: requests become domain values, manifests travel as their JSON. Every
failure leaves as one status with a clear message and its `m27-error` kind; an unexpected
one is logged with its traceback here and reaches the client only as INTERNAL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, NoReturn

import grpc
import msgspec

from m27.checkpoint_store._store import CheckpointStore
from m27.common import api_access
from m27.common.api_auth import caller
from m27.common.checkpoint_api import (
    CheckpointStoreError,
    InvalidCheckpointRequest,
    error_metadata,
    summary_to_proto,
)
from m27.common.errors import M27Error, PermissionDenied
from m27.common.grpc_server import Register, refuse
from m27.common.logging import bound_contextvars, get_logger
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

log = get_logger()

SERVICE_NAME: Final = "m27.v1.CheckpointService"

INTERNAL_MESSAGE: Final = "internal error in the checkpoint-store; its log has the details"
#: A hostile task_id can be megabytes long; log lines keep only its start.
LOGGED_ID_CHARS: Final = 200

Context = grpc.aio.ServicerContext[Any, Any]


def logged(value: str) -> str:
    return value[:LOGGED_ID_CHARS]


async def _fail(context: Context, exc: Exception, rpc: str, **fields: str) -> NoReturn:
    """End the RPC with the status for `exc`; log unexpected ones with their traceback."""
    if isinstance(exc, CheckpointStoreError):
        log.info("checkpoint.rejected", rpc=rpc, code=exc.status, error=str(exc), **fields)
        await refuse(context, exc, metadata=error_metadata(exc))
    if isinstance(exc, M27Error):  # e.g. a PutChunks message that does not parse
        log.info("checkpoint.rejected", rpc=rpc, code=exc.status, error=str(exc), **fields)
        await refuse(context, exc)
    log.error("checkpoint.internal_error", rpc=rpc, error=repr(exc), exc_info=exc, **fields)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


async def read_header(requests: AsyncIterator[pb.PutChunksRequest]) -> pb.PutChunksHeader:
    """The header that must open a PutChunks stream."""
    first = await anext(requests, None)
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidCheckpointRequest("a PutChunks stream must start with the header message")
    return first.header


async def chunk_parts(requests: AsyncIterator[pb.PutChunksRequest]
                      ) -> AsyncIterator[tuple[str, bytes]]:
    """(id, data) of the messages after the header; a second header is an error."""
    index = 1
    async for message in requests:
        part = message.WhichOneof("part")
        if part == "header":
            raise InvalidCheckpointRequest(
                f"a PutChunks stream carries exactly one header; message {index} is another")
        if part != "chunk":
            raise InvalidCheckpointRequest(f"PutChunks message {index} carries no chunk")
        yield message.chunk.id, message.chunk.data
        index += 1


async def _require_scope(context: Context, task_id: str, attempt: int) -> None:
    """A step's token writes only its own task attempt's checkpoints."""
    problem = api_access.checkpoint_problem(caller(), task_id, attempt)
    if problem:
        await refuse(context, PermissionDenied(problem))


def _json(value: msgspec.Struct) -> str:
    return msgspec.json.encode(value).decode()


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    """The eight RPCs; each puts its task_id on the log lines it writes."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store

    async def MissingChunks(self, request: pb.MissingChunksRequest,
                            context: Context) -> pb.MissingChunksResponse:
        await _require_scope(context, request.task_id, request.attempt)
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                absent = await self._store.missing(request.task_id, request.attempt,
                                                   list(request.ids))
            except Exception as exc:
                await _fail(context, exc, "MissingChunks")
        return pb.MissingChunksResponse(ids=absent)

    async def PutChunks(self, request_iterator: AsyncIterator[pb.PutChunksRequest],
                        context: Context) -> pb.PutChunksResponse:
        try:
            header = await read_header(request_iterator)
        except Exception as exc:
            await _fail(context, exc, "PutChunks")
        await _require_scope(context, header.task_id, header.attempt)
        try:
            with bound_contextvars(task_id=logged(header.task_id)):
                result = await self._store.put_chunks(header.task_id, header.attempt,
                                                      chunk_parts(request_iterator))
                log.info("checkpoint.chunks_stored", attempt=header.attempt,
                         received=result.received, stored=result.stored,
                         stored_bytes=result.stored_bytes)
        except Exception as exc:
            await _fail(context, exc, "PutChunks")
        return pb.PutChunksResponse(received=result.received, stored=result.stored,
                                    stored_bytes=result.stored_bytes)

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        await _require_scope(context, request.task_id, request.attempt)
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                result = await self._store.commit(request.task_id, request.attempt,
                                                  request.manifest_json)
            except Exception as exc:
                await _fail(context, exc, "Commit")
            manifest = result.manifest
            log.info("checkpoint.committed", checkpoint_id=manifest.checkpoint_id,
                     attempt=manifest.attempt, seq=manifest.seq, size_bytes=manifest.size_bytes,
                     new_bytes=manifest.new_bytes, full=manifest.full,
                     retired=list(result.deleted))
        return pb.CommitResponse(manifest_json=_json(manifest), deleted=result.deleted)

    async def GetManifest(self, request: pb.GetManifestRequest,
                          context: Context) -> pb.GetManifestResponse:
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                manifest, skipped = await self._store.get_manifest(request.task_id,
                                                                   request.checkpoint_id)
            except Exception as exc:
                await _fail(context, exc, "GetManifest")
        return pb.GetManifestResponse(manifest_json=_json(manifest), skipped=skipped)

    async def GetChunks(self, request: pb.GetChunksRequest,
                        context: Context) -> AsyncIterator[pb.Chunk]:
        try:
            async for chunk_id, data in self._store.get_chunks(list(request.ids)):
                yield pb.Chunk(id=chunk_id, data=data)
        except Exception as exc:
            await _fail(context, exc, "GetChunks")

    async def List(self, request: pb.ListRequest, context: Context) -> pb.ListResponse:
        with bound_contextvars(task_id=logged(request.task_id or request.run_id)):
            try:
                summaries = await self._store.list(request.task_id, request.run_id,
                                                    with_removal=request.with_removal)
            except Exception as exc:
                await _fail(context, exc, "List")
        return pb.ListResponse(checkpoints=[summary_to_proto(s) for s in summaries])

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                deleted = await self._store.delete(request.task_id, request.checkpoint_id)
            except Exception as exc:
                await _fail(context, exc, "Delete")
            log.info("checkpoint.deleted", checkpoint_id=request.checkpoint_id,
                     existed=deleted)
        return pb.DeleteResponse(deleted=deleted)


    async def Protect(self, request: pb.ProtectRequest, context: Context) -> pb.ProtectResponse:
        await _require_scope(context, request.task_id, request.attempt)
        with bound_contextvars(task_id=logged(request.task_id)):
            try:
                checkpoint_id = await self._store.protect(
                    request.task_id, request.attempt,
                    request.before_step if request.HasField("before_step") else None,
                    request.before, request.reason)
            except Exception as exc:
                await _fail(context, exc, "Protect")
            log.info("checkpoint.protected", checkpoint_id=checkpoint_id or None,
                     attempt=request.attempt, reason=logged(request.reason))
        return pb.ProtectResponse(checkpoint_id=checkpoint_id)


def register(servicer: CheckpointServicer) -> Register:
    """A `Register` callback for `ServiceRuntime.serve_grpc`."""

    def add(server: grpc.aio.Server) -> None:
        pb_grpc.add_CheckpointServiceServicer_to_server(servicer, server)

    return add
