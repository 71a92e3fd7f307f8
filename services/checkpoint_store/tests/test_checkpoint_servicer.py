"""The gRPC edge in-process (no NATS): stream shape rules and error → status mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from m27.checkpoint_store._blobs import FileBlobStore
from m27.checkpoint_store._errors import (
    BlobMissing,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreError,
    CheckpointTooLarge,
    InvalidCheckpointRequest,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from m27.checkpoint_store._index import MemoryRecordIndex
from m27.checkpoint_store._servicer import (
    INTERNAL_MESSAGE,
    SERVICE_NAME,
    CheckpointServicer,
    register,
    status_code,
)
from m27.checkpoint_store._store import CheckpointStore
from m27.common.grpc_server import start_server
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

TASK = "r-20240101-120000-abc123/train"
Code = grpc.StatusCode


@pytest.mark.parametrize(("error", "code"), [
    (InvalidCheckpointRequest("x"), Code.INVALID_ARGUMENT),
    (CheckpointNotFound("x"), Code.NOT_FOUND),
    (CheckpointTooLarge("x"), Code.RESOURCE_EXHAUSTED),
    (StorageFull("x"), Code.RESOURCE_EXHAUSTED),
    (CheckpointCorrupt("x"), Code.DATA_LOSS),
    (StorageUnavailable("x"), Code.UNAVAILABLE),
    (StorageError("x"), Code.INTERNAL),
    (BlobMissing("x"), Code.INTERNAL),
    (CheckpointStoreError("x"), Code.INTERNAL),
])
def test_every_error_family_has_its_status(error: CheckpointStoreError, code: Code) -> None:
    assert status_code(error) == code


class Boom(CheckpointStore):
    async def list(self, task_id: str) -> list[object]:  # type: ignore[override]
        raise RuntimeError("secret internal detail")


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[pb_grpc.CheckpointServiceAsyncStub]:
    store = CheckpointStore(FileBlobStore(tmp_path / "root"), MemoryRecordIndex(), max_bytes=100)
    await store.recover()
    server = await start_server("127.0.0.1:0", [register(CheckpointServicer(store))],
                                [SERVICE_NAME])
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.CheckpointServiceStub(channel)
    await server.stop(0)


async def put(stub: pb_grpc.CheckpointServiceAsyncStub,
              messages: Sequence[pb.PutRequest]) -> pb.CheckpointInfo:
    async def requests() -> AsyncIterator[pb.PutRequest]:
        for message in messages:
            yield message

    return await stub.Put(requests())


def header(task_id: str = TASK, **fields: object) -> pb.PutRequest:
    return pb.PutRequest(header=pb.CheckpointHeader(task_id=task_id, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("messages", "code", "message"), [
    ([], Code.INVALID_ARGUMENT, "must start with the header"),
    ([pb.PutRequest(data=b"x")], Code.INVALID_ARGUMENT, "must start with the header"),
    ([header(), pb.PutRequest(data=b"x"), header()], Code.INVALID_ARGUMENT,
     "message 2 is a second one"),
    ([header(), pb.PutRequest()], Code.INVALID_ARGUMENT, "neither header nor data"),
    ([header("../../etc")], Code.INVALID_ARGUMENT, "task_id must be"),
    ([header(attempt=-1)], Code.INVALID_ARGUMENT, "attempt must be"),
    ([header(), pb.PutRequest(data=b"x" * 101)], Code.RESOURCE_EXHAUSTED, "at most 100 bytes"),
])
async def test_bad_put_streams_get_clear_statuses(
        stub: pb_grpc.CheckpointServiceAsyncStub, messages: list[pb.PutRequest], code: Code,
        message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put(stub, messages)
    assert caught.value.code() == code
    assert message in (caught.value.details() or "")


async def test_put_get_list_delete_round_trip(stub: pb_grpc.CheckpointServiceAsyncStub) -> None:
    info = await put(stub, [header(name="e1", metadata={"k": "v"}),
                            pb.PutRequest(data=b"abc"), pb.PutRequest(data=b"")])
    assert (info.size_bytes, info.name, dict(info.metadata)) == (3, "e1", {"k": "v"})
    replies = [r async for r in stub.Get(pb.GetRequest(task_id=TASK))]
    assert replies[0].info == info
    assert b"".join(r.data for r in replies[1:]) == b"abc"
    listed = await stub.List(pb.ListRequest(task_id=TASK))
    assert list(listed.checkpoints) == [info]
    deleted = await stub.Delete(pb.DeleteRequest(task_id=TASK,
                                                 checkpoint_id=info.checkpoint_id))
    assert deleted.deleted is True
    assert list((await stub.List(pb.ListRequest(task_id=TASK))).checkpoints) == []


async def test_an_unexpected_error_is_internal_without_details(tmp_path: Path) -> None:
    """A bug inside the store reaches the client as INTERNAL with no traceback or detail."""
    store = Boom(FileBlobStore(tmp_path / "root"), MemoryRecordIndex())
    server = await start_server("127.0.0.1:0", [register(CheckpointServicer(store))],
                                [SERVICE_NAME])
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.CheckpointServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.List(pb.ListRequest(task_id=TASK))
    finally:
        await server.stop(0)
    assert caught.value.code() == Code.INTERNAL
    assert caught.value.details() == INTERNAL_MESSAGE
