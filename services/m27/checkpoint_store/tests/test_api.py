"""The gRPC edge in-process (no NATS): stream rules, error → status → client exception, and
both clients (the sync `RemoteStore` runs in a worker thread, as the training library
calls it)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import msgspec
import pytest

from m27.checkpoint_store._chunks import ChunkStore
from m27.checkpoint_store._index import MemoryManifestIndex
from m27.checkpoint_store._store import CheckpointStore
from m27.checkpoint_store.api import (
    INTERNAL_MESSAGE,
    SERVICE_NAME,
    CheckpointServicer,
    register,
)
from m27.client.checkpoints import (
    CHANNEL_OPTIONS,
    CheckpointClient,
    RemoteStore,
    upload_batches,
)
from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.checkpoint_api import (
    ERROR_KIND_KEY,
    ERRORS_BY_KIND,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreError,
    CheckpointTooLarge,
    ChunkMissing,
    ChunksMissing,
    InvalidCheckpointRequest,
    StaleAttempt,
    StorageError,
    StorageFull,
    StorageUnavailable,
    error_from_status,
    rpc_error,
)
from m27.common.checkpoint_format import CorruptChunk, Manifest, plan_entry
from m27.common.grpc_server import GrpcServer, start_server, status_of
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

KEYS = ephemeral_keys()
ADMIN = ApiAccess(token=KEYS.mint(user="tester", role="admin", ttl_s=0))


RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
Code = grpc.StatusCode


@pytest.mark.parametrize(("error", "code"), [
    (InvalidCheckpointRequest("x"), Code.INVALID_ARGUMENT),
    (CheckpointNotFound("x"), Code.NOT_FOUND),
    (ChunkMissing("x"), Code.NOT_FOUND),
    (CheckpointTooLarge("x"), Code.RESOURCE_EXHAUSTED),
    (StorageFull("x"), Code.RESOURCE_EXHAUSTED),
    (CheckpointCorrupt("x"), Code.DATA_LOSS),
    (StorageUnavailable("x"), Code.UNAVAILABLE),
    (StaleAttempt("x"), Code.FAILED_PRECONDITION),
    (ChunksMissing("x"), Code.FAILED_PRECONDITION),
    (StorageError("x"), Code.INTERNAL),
    (CheckpointStoreError("x"), Code.INTERNAL),
])
def test_every_error_family_has_its_status(error: CheckpointStoreError, code: Code) -> None:
    assert status_of(error) == code


@pytest.mark.parametrize("kind", sorted(ERRORS_BY_KIND))
def test_the_client_raises_the_class_the_server_named(kind: str) -> None:
    error = error_from_status(Code.FAILED_PRECONDITION, "why", [(ERROR_KIND_KEY, kind)])
    assert type(error) is ERRORS_BY_KIND[kind]
    assert str(error) == "checkpoint-store: why"


def test_without_a_kind_the_status_code_decides() -> None:
    assert isinstance(error_from_status(Code.DATA_LOSS, None, None), CheckpointCorrupt)
    assert isinstance(error_from_status(Code.UNKNOWN, "?", ()), CheckpointStoreError)
    assert isinstance(CheckpointCorrupt("x"), CorruptChunk)  # restores catch either


def test_big_uploads_are_split_into_calls_of_bounded_size() -> None:
    """Each call's deadline covers its own transfer, however large the checkpoint."""
    chunks = {f"{i:064x}": b"x" * size for i, size in enumerate([40, 40, 30, 100, 10])}
    groups = [list(batch) for batch in upload_batches(chunks, limit=100)]
    assert groups == [[f"{0:064x}", f"{1:064x}"], [f"{2:064x}"], [f"{3:064x}"],
                      [f"{4:064x}"]]
    assert list(upload_batches({})) == []


class Boom(CheckpointStore):
    async def list(self, task_id: str = "", run_id: str = "") -> list[object]:  # type: ignore[override]
        raise RuntimeError("secret internal detail")


async def serve(store: CheckpointStore) -> GrpcServer:
    return await start_server("127.0.0.1:0", [register(CheckpointServicer(store))],
                              [SERVICE_NAME], keys=KEYS)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GrpcServer]:
    chunks = ChunkStore(tmp_path / "root")
    chunks.prepare()

    async def assigned(task_id: str) -> int | None:
        return 2 if task_id == TASK else None

    store = CheckpointStore(chunks, MemoryManifestIndex(), max_bytes=1 << 20,
                            assigned_attempt=assigned)
    server = await serve(store)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[pb_grpc.CheckpointServiceAsyncStub]:
    async with ADMIN.channel(server.address) as channel:
        yield pb_grpc.CheckpointServiceStub(channel)


def kind_of(error: grpc.aio.AioRpcError) -> str:
    """The `m27-error` kind a status carried (as the clients read it)."""
    return rpc_error(error).kind


def header(task_id: str = TASK, attempt: int = 2) -> pb.PutChunksRequest:
    return pb.PutChunksRequest(header=pb.PutChunksHeader(task_id=task_id, attempt=attempt))


def chunk(data: bytes, chunk_id: str | None = None) -> pb.PutChunksRequest:
    return pb.PutChunksRequest(chunk=pb.Chunk(id=chunk_id or hashlib.sha256(data).hexdigest(),
                                              data=data))


async def put(stub: pb_grpc.CheckpointServiceAsyncStub,
              messages: Sequence[pb.PutChunksRequest]) -> pb.PutChunksResponse:
    async def requests() -> AsyncIterator[pb.PutChunksRequest]:
        for message in messages:
            yield message

    return await stub.PutChunks(requests())


@pytest.mark.parametrize(("messages", "code", "message", "kind"), [
    ([], Code.INVALID_ARGUMENT, "must start with the header", "invalid"),
    ([chunk(b"x")], Code.INVALID_ARGUMENT, "must start with the header", "invalid"),
    ([header(), chunk(b"x"), header()], Code.INVALID_ARGUMENT, "message 2 is another",
     "invalid"),
    ([header(), pb.PutChunksRequest()], Code.INVALID_ARGUMENT, "carries no chunk", "invalid"),
    ([header("../../etc")], Code.INVALID_ARGUMENT, "task_id must be", "invalid"),
    ([header(attempt=-1)], Code.INVALID_ARGUMENT, "attempt must be", "invalid"),
    ([header(attempt=1)], Code.FAILED_PRECONDITION, "is stale", "stale_attempt"),
    ([header(), chunk(b"x", "../" * 21 + "a")], Code.INVALID_ARGUMENT, "64 lower-case hex",
     "invalid"),
    ([header(), chunk(b"x", "a" * 64)], Code.DATA_LOSS, "does not match its bytes",
     "chunk_corrupt"),
    ([header(), *(chunk(bytes([i]) * (1 << 20)) for i in range(3))], Code.RESOURCE_EXHAUSTED,
     "at most 1048576 bytes", "too_large"),
])
async def test_bad_put_streams_get_clear_statuses(
        stub: pb_grpc.CheckpointServiceAsyncStub, messages: list[pb.PutChunksRequest],
        code: Code, message: str, kind: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put(stub, messages)
    assert caught.value.code() == code
    assert message in (caught.value.details() or "")
    assert kind_of(caught.value) == kind


async def test_put_counts_what_was_new(stub: pb_grpc.CheckpointServiceAsyncStub) -> None:
    first = await put(stub, [header(), chunk(b"a"), chunk(b"bb")])
    assert (first.received, first.stored, first.stored_bytes) == (2, 2, 3)
    again = await put(stub, [header(), chunk(b"a"), chunk(b"ccc")])
    assert (again.received, again.stored, again.stored_bytes) == (2, 1, 3)
    missing = await stub.MissingChunks(pb.MissingChunksRequest(
        ids=[hashlib.sha256(d).hexdigest() for d in (b"a", b"zz")]))
    assert list(missing.ids) == [hashlib.sha256(b"zz").hexdigest()]


def manifest_of(data: bytes, attempt: int = 2, task_id: str = TASK) -> tuple[Manifest,
                                                                              dict[str, bytes]]:
    import zstandard

    entry, chunks = plan_entry("state", "bytes", memoryview(data), None, delta=False,
                               compressor=zstandard.ZstdCompressor())
    return Manifest(task_id=task_id, attempt=attempt, entries=(entry,)), chunks


async def test_commit_without_chunks_is_a_failed_precondition_of_its_own_kind(
        stub: pb_grpc.CheckpointServiceAsyncStub) -> None:
    manifest, _ = manifest_of(b"never uploaded")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Commit(pb.CommitRequest(task_id=TASK, attempt=2,
                                           manifest_json=msgspec.json.encode(manifest).decode()))
    assert caught.value.code() == Code.FAILED_PRECONDITION
    assert kind_of(caught.value) == "chunks_missing"


async def test_the_async_client_round_trips_and_raises_domain_errors(
        server: GrpcServer) -> None:
    data = b"state of the model" * 10_000
    async with ADMIN.channel(server.address, options=CHANNEL_OPTIONS) as channel:
        client = CheckpointClient(channel, timeout_s=10)
        stored = await client.put_bytes(TASK, data, attempt=2, name="step-1",
                                        metadata={"epoch": "1"})
        assert (stored.name, stored.attempt, stored.metadata, stored.seq) == \
            ("step-1", 2, {"epoch": "1"}, 1)
        got, payload = await client.get_bytes(TASK)
        assert (got, payload) == (stored, data)
        assert [s.checkpoint_id for s in await client.list(TASK)] == [stored.checkpoint_id]
        with pytest.raises(StaleAttempt, match=r"attempt 1 of .* is stale"):
            await client.put_bytes(TASK, b"late", attempt=1)
        with pytest.raises(CheckpointTooLarge):
            await client.put_bytes(TASK, b"x" * ((1 << 20) + 1), attempt=2)
        with pytest.raises(CheckpointNotFound):
            await client.get_manifest(TASK, "c-0000000000001-000000")
        assert await client.latest(f"{RUN}/never") is None
        assert await client.delete(TASK, stored.checkpoint_id) is True
        assert await client.list(TASK) == []


async def test_remote_store_is_a_checkpoint_sink_from_threads(server: GrpcServer) -> None:
    """What the training library does, from worker threads: missing → put_chunks →
    commit, then latest / list / read_chunk; writes need the store's task and attempt."""
    remote = RemoteStore(server.address, task_id=TASK, attempt=2, timeout_s=10,
                         access=ADMIN)
    try:
        manifests = [manifest_of(bytes([i]) * 5000) for i in range(3)]

        def write(manifest: Manifest, chunks: dict[str, bytes]) -> Manifest:
            absent = remote.missing(sorted(chunks))
            remote.put_chunks({k: v for k, v in chunks.items() if k in absent})
            return remote.commit(manifest)

        committed = await asyncio.gather(*(asyncio.to_thread(write, m, c)
                                           for m, c in manifests))
        assert len({m.checkpoint_id for m in committed}) == 3
        latest = await asyncio.to_thread(remote.latest, TASK)
        assert latest == max(committed, key=lambda m: m.checkpoint_id)
        listed = await asyncio.to_thread(remote.list, TASK)
        assert [m.checkpoint_id for m in listed] == sorted(m.checkpoint_id for m in committed)
        ref = listed[0].entries[0].chunks[0]
        assert len(await asyncio.to_thread(remote.read_chunk, ref.id)) == ref.stored
        with pytest.raises(ChunkMissing):
            await asyncio.to_thread(remote.read_chunk, "0" * 64)
        assert await asyncio.to_thread(remote.latest, f"{RUN}/other") is None
        reader = RemoteStore(server.address, task_id="", timeout_s=10, access=ADMIN)
        with pytest.raises(InvalidCheckpointRequest, match="no task to write for"):
            await asyncio.to_thread(reader.put_chunks, manifests[0][1])
        reader.close()
        stale = RemoteStore(server.address, task_id=TASK, attempt=1, timeout_s=10,
                            access=ADMIN)
        with pytest.raises(StaleAttempt):
            await asyncio.to_thread(stale.missing, ["0" * 64])
        stale.close()
    finally:
        remote.close()


async def test_an_unexpected_error_is_internal_without_details(tmp_path: Path) -> None:
    """A bug inside the store reaches the client as INTERNAL with no traceback or detail."""
    store = Boom(ChunkStore(tmp_path / "root"), MemoryManifestIndex())
    server = await serve(store)
    try:
        async with ADMIN.channel(server.address) as channel:
            stub = pb_grpc.CheckpointServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.List(pb.ListRequest(task_id=TASK))
    finally:
        await server.stop(0)
    assert caught.value.code() == Code.INTERNAL
    assert caught.value.details() == INTERNAL_MESSAGE


async def test_a_step_token_writes_only_its_own_task_attempt(server: GrpcServer) -> None:
    """The token a node-agent hands a step: its own task attempt's checkpoints only; no
    other task's, no other attempt's, no deleting — each refused before the store acts."""
    def as_step(task: str, attempt: int) -> ApiAccess:
        return ApiAccess(token=KEYS.mint(user="step-2", role="step", task_id=task,
                                         attempt=attempt, ttl_s=0))

    own = RemoteStore(server.address, task_id=TASK, attempt=2, timeout_s=10,
                      access=as_step(TASK, 2))
    try:
        stored = await asyncio.to_thread(own.put_bytes, TASK, b"mine" * 100, attempt=2)
        assert stored.attempt == 2
        for task, attempt in ((f"{RUN}/other", 2), (TASK, 3)):
            with pytest.raises(CheckpointStoreError, match="this step's token is for"):
                await asyncio.to_thread(own.put_bytes, task, b"theirs", attempt=attempt)
        with pytest.raises(CheckpointStoreError, match="Delete needs the role admin"):
            await asyncio.to_thread(own.delete, TASK, stored.checkpoint_id)
    finally:
        own.close()
    other = RemoteStore(server.address, task_id=TASK, attempt=2, timeout_s=10,
                        access=as_step(f"{RUN}/other", 2))
    try:  # PutChunks straight to the stream, not through MissingChunks first
        with pytest.raises(CheckpointStoreError, match="this step's token is for"):
            await asyncio.to_thread(other.put_chunks, {"0" * 64: b"x"})
    finally:
        other.close()


async def test_a_listing_says_when_checkpoints_go_only_when_asked(tmp_path: Path) -> None:
    """`with_removal` crosses the wire both ways (both clients); without it, as a node's
    agent lists before each upload, the store reads no run record."""
    chunks = ChunkStore(tmp_path / "root")
    chunks.prepare()
    asked: list[str] = []

    async def run_ended(run_id: str) -> float | None:
        asked.append(run_id)
        return 1000.0

    store = CheckpointStore(chunks, MemoryManifestIndex(), keep_finished_s=60.0,
                            run_ended=run_ended)
    server = await serve(store)
    remote = RemoteStore(server.address, task_id=TASK, timeout_s=10, access=ADMIN)
    try:
        await asyncio.to_thread(remote.put_bytes, TASK, b"weights" * 100, attempt=0)
        plain = await asyncio.to_thread(remote.summaries, TASK)
        assert [s.removed_at for s in plain] == [None]
        assert asked == []
        assert len(await asyncio.to_thread(remote.list, TASK)) == 1
        assert asked == []
        asked_for = await asyncio.to_thread(
            lambda: remote.summaries(run_id=RUN, with_removal=True))
        assert [s.removed_at for s in asked_for] == [1060.0]
        assert asked == [RUN]
        async with ADMIN.channel(server.address, options=CHANNEL_OPTIONS) as channel:
            client = CheckpointClient(channel, timeout_s=10)
            assert [s.removed_at for s in await client.list(TASK)] == [None]
            assert [s.removed_at for s in await client.list(TASK, with_removal=True)] == \
                [1060.0]
    finally:
        remote.close()
        await server.stop(0)
