"""A small async client of `m27.v1.CheckpointService` that speaks domain types.

Callers get `CheckpointRecord`s and bytes, and the store's own errors instead of gRPC
statuses (NOT_FOUND → CheckpointNotFound, DATA_LOSS → CheckpointCorrupt, ...). `get`
checks the sha256 again on this side, so corruption in transit is caught as well.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Final

import grpc

from m27.checkpoint_store._convert import record_from_proto
from m27.checkpoint_store._errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreError,
    CheckpointTooLarge,
    InvalidCheckpointRequest,
    StorageUnavailable,
)
from m27.checkpoint_store._model import CheckpointRecord
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

PART_BYTES: Final = 1024 * 1024
_ERRORS: Final[dict[grpc.StatusCode, type[CheckpointStoreError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidCheckpointRequest,
    grpc.StatusCode.NOT_FOUND: CheckpointNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CheckpointTooLarge,
    grpc.StatusCode.DATA_LOSS: CheckpointCorrupt,
    grpc.StatusCode.UNAVAILABLE: StorageUnavailable,
}

Data = bytes | bytearray | memoryview | Iterable[bytes] | AsyncIterable[bytes]


@contextlib.contextmanager
def _rpc_errors() -> Iterator[None]:
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        kind = _ERRORS.get(exc.code(), CheckpointStoreError)
        raise kind(f"checkpoint-store: {exc.details() or exc.code().name}") from None


async def _parts(data: Data, part_bytes: int) -> AsyncIterator[bytes]:
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data).cast("B")
        for start in range(0, len(view), part_bytes):
            yield bytes(view[start:start + part_bytes])
    elif isinstance(data, AsyncIterable):
        async for part in data:
            yield part
    else:
        for part in data:
            yield part


class CheckpointClient:
    """Put, Get, List and Delete against one checkpoint-store channel."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float | None = None) -> None:
        self._stub = pb_grpc.CheckpointServiceStub(channel)
        self._timeout = timeout_s

    async def put(self, task_id: str, data: Data, *, attempt: int = 0, name: str = "",
                  metadata: Mapping[str, str] | None = None,
                  part_bytes: int = PART_BYTES) -> CheckpointRecord:
        """Store `data` (bytes, or an iterable of parts) as a new checkpoint of `task_id`."""
        header = pb.CheckpointHeader(task_id=task_id, attempt=attempt, name=name,
                                     metadata=dict(metadata or {}))

        async def requests() -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=header)
            async for part in _parts(data, part_bytes):
                yield pb.PutRequest(data=part)

        with _rpc_errors():
            info = await self._stub.Put(requests(), timeout=self._timeout)
        return record_from_proto(info)

    async def get(self, task_id: str, checkpoint_id: str = "") -> tuple[CheckpointRecord, bytes]:
        """A checkpoint and its bytes (an empty id: the latest), verified on arrival.

        The whole blob is held in memory; fine for model states of a few GiB at most.
        """
        record: CheckpointRecord | None = None
        data = bytearray()
        with _rpc_errors():
            call = self._stub.Get(pb.GetRequest(task_id=task_id, checkpoint_id=checkpoint_id),
                                  timeout=self._timeout)
            async for message in call:
                if message.WhichOneof("part") == "info":
                    record = record_from_proto(message.info)
                else:
                    data += message.data
        if record is None:
            raise CheckpointStoreError("checkpoint-store: Get ended without the checkpoint info")
        if len(data) != record.size_bytes or hashlib.sha256(data).hexdigest() != record.sha256:
            raise CheckpointCorrupt(f"checkpoint {record.checkpoint_id} arrived damaged")
        return record, bytes(data)

    async def list(self, task_id: str) -> list[CheckpointRecord]:
        """The task's checkpoints, oldest first."""
        with _rpc_errors():
            reply = await self._stub.List(pb.ListRequest(task_id=task_id),
                                          timeout=self._timeout)
        return [record_from_proto(info) for info in reply.checkpoints]

    async def delete(self, task_id: str, checkpoint_id: str) -> bool:
        """Remove one checkpoint; False when it did not exist."""
        with _rpc_errors():
            reply = await self._stub.Delete(
                pb.DeleteRequest(task_id=task_id, checkpoint_id=checkpoint_id),
                timeout=self._timeout)
        return reply.deleted
