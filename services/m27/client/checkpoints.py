"""Clients of `m27.v1.CheckpointService` that speak domain types.

- `RemoteStore(address)`: synchronous, a `checkpoint_storage.CheckpointSink`; what the
  training library and the node-agent's file uploads write through. Safe to share between
  threads (one gRPC channel; calls carry no client-side state).
- `CheckpointClient(channel)`: the same over an asyncio channel.

Both raise the store's own exceptions (StaleAttempt, CheckpointNotFound, CheckpointCorrupt,
ChunksMissing, ...), verify every chunk they receive against its id, and offer
`put_bytes`/`get_bytes` for an opaque blob: one `bytes` entry built on the chunk API, so a
blob that did not change costs no upload.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Final, TypeVar

import grpc
import msgspec
import zstandard

from m27.common.api_auth import ApiAccess, default_access
from m27.common.checkpoint_api import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointSummary,
    InvalidCheckpointRequest,
    StorageUnavailable,
    manifest_from_json,
    manifest_json,
    rpc_error,
    summary_from_proto,
)
from m27.common.checkpoint_format import (
    Entry,
    Manifest,
    Payload,
    chunk_ids,
    plan_entry,
    read_entry,
    sha256,
)
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

BLOB_ENTRY: Final = "data"
IDS_PER_CALL: Final = 16384
#: Each call's deadline must cover its transfer: big uploads and reads are split in calls
#: of about 256 MiB (64 chunks of 4 MiB).
UPLOAD_BYTES_PER_CALL: Final = 256 * 1024 * 1024
CHUNKS_PER_READ: Final = 64
DEFAULT_LEVEL: Final = 3
#: Calls safe to repeat are retried by gRPC itself while the store restarts.
_RETRIED: Final = ("MissingChunks", "PutChunks", "GetManifest", "GetChunks", "List")
SERVICE_CONFIG: Final = json.dumps({"methodConfig": [{
    "name": [{"service": "m27.v1.CheckpointService", "method": m} for m in _RETRIED],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "3s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})
CHANNEL_OPTIONS: Final = [*CLIENT_OPTIONS, ("grpc.service_config", SERVICE_CONFIG)]
#: Spelled once here: inside the classes `list` is a method.
Summaries = list[CheckpointSummary]


class PutSummary(msgspec.Struct, frozen=True):
    received: int
    stored: int
    stored_bytes: int


def plan_bytes(task_id: str, data: bytes | bytearray | memoryview, *, attempt: int,
               name: str, metadata: Mapping[str, str] | None = None,
               level: int = DEFAULT_LEVEL) -> tuple[Manifest, dict[str, bytes]]:
    """A one-entry manifest of an opaque blob and its chunks (id → stored bytes)."""
    entry, chunks = plan_entry(BLOB_ENTRY, "bytes", memoryview(data).cast("B"), None,
                               delta=False, compressor=zstandard.ZstdCompressor(level=level))
    manifest = Manifest(task_id=task_id, attempt=attempt, name=name, created_at=time.time(),
                        entries=(entry,), size_bytes=entry.size,
                        metadata=dict(metadata or {}))
    return manifest, chunks


def blob_entry(manifest: Manifest) -> Entry:
    entry = manifest.entry(BLOB_ENTRY) or (manifest.entries[0]
                                           if len(manifest.entries) == 1 else None)
    if entry is None:
        raise CheckpointNotFound(f"checkpoint {manifest.checkpoint_id} holds no single blob "
                                 f"(entries: {', '.join(e.name for e in manifest.entries)})")
    return entry


def needed_ids(entries: Iterable[Entry]) -> list[str]:
    """The chunk ids of some entries (delta bases included), each once, in order."""
    ids = [i for entry in entries for i in sorted(chunk_ids(Manifest(task_id="",
                                                                      entries=(entry,))))]
    return list(dict.fromkeys(ids))


def put_requests(task_id: str, attempt: int,
                 chunks: Mapping[str, Payload]) -> Iterator[pb.PutChunksRequest]:
    yield pb.PutChunksRequest(header=pb.PutChunksHeader(task_id=task_id, attempt=attempt))
    for chunk_id, data in chunks.items():
        yield pb.PutChunksRequest(chunk=pb.Chunk(id=chunk_id, data=bytes(data)))


def verified(chunk: pb.Chunk, expected: str) -> tuple[str, bytes]:
    if chunk.id != expected or sha256(chunk.data) != expected:
        raise CheckpointCorrupt(f"chunk {expected} arrived damaged or out of order")
    return chunk.id, chunk.data


def received(chunks: Iterable[pb.Chunk], expected: Sequence[str]) -> Iterator[tuple[str, bytes]]:
    """The chunks of one GetChunks reply, each checked against the id asked for."""
    count = 0
    for chunk in chunks:
        yield verified(chunk, expected[count] if count < len(expected) else "")
        count += 1
    if count != len(expected):
        raise CheckpointCorrupt(f"checkpoint-store sent {count} of {len(expected)} chunks")


def batches(ids: Sequence[str], size: int = IDS_PER_CALL) -> Iterator[list[str]]:
    for start in range(0, len(ids), size):
        yield list(ids[start:start + size])


def upload_batches(chunks: Mapping[str, Payload],
                   limit: int = UPLOAD_BYTES_PER_CALL) -> Iterator[dict[str, Payload]]:
    """The chunks in groups of at most `limit` bytes (a larger chunk alone)."""
    batch: dict[str, Payload] = {}
    size = 0
    for chunk_id, data in chunks.items():
        if batch and size + len(data) > limit:
            yield batch
            batch, size = {}, 0
        batch[chunk_id] = data
        size += len(data)
    if batch:
        yield batch


def added(total: PutSummary, reply: pb.PutChunksResponse) -> PutSummary:
    return PutSummary(total.received + reply.received, total.stored + reply.stored,
                      total.stored_bytes + reply.stored_bytes)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        raise rpc_error(exc) from None


T = TypeVar("T")
#: The first wait before a call is tried again while the store cannot be reached; it
#: doubles up to the second (a restarting store is back in seconds).
OUTAGE_FIRST_S: Final = 0.5
OUTAGE_MAX_S: Final = 5.0


def next_wait(began: float, now: float, wait: float, outage_s: float) -> float | None:
    """Seconds to wait before trying again a call first tried at `began`, or None (give up)
    when that wait would end past `outage_s` after `began`."""
    return None if now + wait > began + outage_s else wait


class _Patience:
    """The waits between tries of one call through a store outage: 0.5, 1, 2 … 5 s, for
    `outage_s` in all."""

    def __init__(self, outage_s: float) -> None:
        self.outage_s = outage_s
        self.began, self.wait = time.monotonic(), OUTAGE_FIRST_S

    def waited(self) -> bool:
        """Sleep before the next try; False (no sleep) once the outage lasted too long."""
        pause = next_wait(self.began, time.monotonic(), self.wait, self.outage_s)
        if pause is None:
            return False
        time.sleep(pause)
        self.wait = min(self.wait * 2, OUTAGE_MAX_S)
        return True


class RemoteStore:
    """A `CheckpointSink` over gRPC, for one task's attempt (default: `$M27_TASK_ID`,
    `$M27_ATTEMPT`, as the node-agent sets them); reads work for any task."""

    def __init__(self, address: str, *, task_id: str | None = None,
                 attempt: int | None = None, timeout_s: float | None = 300.0,
                 access: ApiAccess | None = None, outage_s: float = 0.0) -> None:
        """`access` default: `$M27_TOKEN` (a step's, set by its node-agent), else this
        user's token (`m27.common.api_auth.user_access`). `outage_s`: how long a call
        waits out a store that cannot be reached (StorageUnavailable: stopped, restarting,
        its KV away), trying again after 0.5, 1, 2 … 5 s; 0 raises at once (after gRPC's
        own few quick retries)."""
        self.address = address
        self.outage_s = outage_s
        self.task_id = os.environ.get("M27_TASK_ID", "") if task_id is None else task_id
        self.attempt = int(os.environ.get("M27_ATTEMPT", "0")) if attempt is None else attempt
        self._timeout = timeout_s
        self._channel = (access or default_access()).sync_channel(address,
                                                                  options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CheckpointServiceStub(self._channel)

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, make: Callable[[], T]) -> T:
        """`make()` with the store's errors, tried again through an outage (`outage_s`)."""
        patience = _Patience(self.outage_s)
        while True:
            try:
                with _errors():
                    return make()
            except StorageUnavailable:
                if not patience.waited():
                    raise

    def _task(self) -> str:
        if not self.task_id:
            raise InvalidCheckpointRequest("this RemoteStore has no task to write for: pass "
                                           "task_id= (or run under m27, which sets M27_TASK_ID)")
        return self.task_id

    # ------------------------------------------------------------ CheckpointSink

    def missing(self, chunk_ids: Sequence[str]) -> set[str]:
        return self._missing(self.task_id, self.attempt, chunk_ids)

    def put_chunks(self, chunks: Mapping[str, Payload]) -> None:
        self.upload(chunks)

    def upload(self, chunks: Mapping[str, Payload]) -> PutSummary:
        """`put_chunks`, telling how many chunks and bytes were new to the store."""
        return self._upload(self._task(), self.attempt, chunks)

    def _missing(self, task_id: str, attempt: int, chunk_ids: Sequence[str]) -> set[str]:
        absent: set[str] = set()
        for batch in batches(chunk_ids):
            request = pb.MissingChunksRequest(task_id=task_id, attempt=attempt, ids=batch)
            reply = self._call(partial(self._stub.MissingChunks, request,
                                       timeout=self._timeout))
            absent.update(reply.ids)
        return absent

    def _upload(self, task_id: str, attempt: int, chunks: Mapping[str, Payload]) -> PutSummary:
        total = PutSummary(0, 0, 0)
        for batch in upload_batches(chunks):
            # a generator of requests is used up by a call: a fresh one for each try
            total = added(total, self._call(partial(self._put, task_id, attempt, batch)))
        return total

    def _put(self, task_id: str, attempt: int, batch: Mapping[str, Payload]
             ) -> pb.PutChunksResponse:
        return self._stub.PutChunks(put_requests(task_id, attempt, batch),
                                    timeout=self._timeout)

    def commit(self, manifest: Manifest) -> Manifest:
        # Tried again through an outage: a commit whose answer was lost may be stored
        # twice, as two checkpoints of the same state (retention drops the older).
        reply = self._call(lambda: self._stub.Commit(pb.CommitRequest(
            task_id=manifest.task_id, attempt=manifest.attempt,
            manifest_json=manifest_json(manifest)), timeout=self._timeout))
        return manifest_from_json(reply.manifest_json)

    def protect(self, before_step: int | None, before: float, reason: str) -> str:
        """Keep this task's last checkpoint from before `before_step` (or, for checkpoints
        without a step, `before`, a time) out of retention; its id, or "" for none."""
        request = pb.ProtectRequest(task_id=self._task(), attempt=self.attempt,
                                    before=before, reason=reason)
        if before_step is not None:
            request.before_step = before_step
        return str(self._call(lambda: self._stub.Protect(request, timeout=self._timeout)
                              ).checkpoint_id)

    def latest(self, task_id: str) -> Manifest | None:
        try:
            return self.get_manifest(task_id)
        except CheckpointNotFound:
            return None

    def list(self, task_id: str) -> list[Manifest]:
        """The task's checkpoints with their entries, oldest first."""
        found: list[Manifest] = []
        for summary in self.summaries(task_id):
            with contextlib.suppress(CheckpointNotFound):  # retired since it was listed
                found.append(self.get_manifest(task_id, summary.checkpoint_id))
        return found

    def read_chunk(self, chunk_id: str) -> bytes:
        ((_, data),) = self.read_chunks([chunk_id])
        return data

    # ------------------------------------------------------------ the rest

    def get_manifest(self, task_id: str, checkpoint_id: str = "") -> Manifest:
        """One checkpoint's manifest; an empty id: the task's latest good one."""
        reply = self._call(lambda: self._stub.GetManifest(pb.GetManifestRequest(
            task_id=task_id, checkpoint_id=checkpoint_id), timeout=self._timeout))
        return manifest_from_json(reply.manifest_json)

    def summaries(self, task_id: str = "", run_id: str = "", *,
                  with_removal: bool = False) -> Summaries:
        """One task's (or run's) checkpoints; `with_removal` also says when each goes,
        at a read of the run's record in the store (leave it off on a hot path)."""
        reply = self._call(lambda: self._stub.List(pb.ListRequest(
            task_id=task_id, run_id=run_id, with_removal=with_removal),
            timeout=self._timeout))
        return [summary_from_proto(s) for s in reply.checkpoints]

    def read_chunks(self, chunk_ids: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        """(id, stored bytes) in the order asked, each verified on arrival; through an
        outage (`outage_s`) a stream cut off goes on from the first chunk not received."""
        for batch in batches(chunk_ids, CHUNKS_PER_READ):
            left, patience = list(batch), _Patience(self.outage_s)
            while left:
                try:
                    with _errors():
                        call = self._stub.GetChunks(pb.GetChunksRequest(ids=left),
                                                    timeout=self._timeout)
                        try:
                            for item in received(call, left):
                                left = left[1:]
                                yield item
                        finally:
                            # Harmless once it ended; stops the stream if we were abandoned.
                            call.cancel()  # type: ignore[no-untyped-call]  # stubs lack it
                except StorageUnavailable:
                    if not patience.waited():
                        raise

    def fetch(self, entries: Iterable[Entry]) -> dict[str, bytes]:
        """Every chunk the entries need, in one stream."""
        return dict(self.read_chunks(needed_ids(entries)))

    def delete(self, task_id: str, checkpoint_id: str) -> bool:
        reply = self._call(lambda: self._stub.Delete(pb.DeleteRequest(
            task_id=task_id, checkpoint_id=checkpoint_id), timeout=self._timeout))
        return reply.deleted

    def put_bytes(self, task_id: str, data: bytes | bytearray | memoryview, *,
                  attempt: int = 0, name: str = "",
                  metadata: Mapping[str, str] | None = None) -> Manifest:
        """Store an opaque blob as a checkpoint of `task_id`; only new chunks are sent."""
        manifest, chunks = plan_bytes(task_id, data, attempt=attempt, name=name,
                                      metadata=metadata)
        absent = self._missing(task_id, attempt, sorted(chunks))
        self._upload(task_id, attempt, {k: v for k, v in chunks.items() if k in absent})
        return self.commit(manifest)

    def get_bytes(self, task_id: str, checkpoint_id: str = "") -> tuple[Manifest, bytes]:
        """A blob stored with `put_bytes` (an empty id: the latest good one), verified."""
        manifest = self.get_manifest(task_id, checkpoint_id)
        entry = blob_entry(manifest)
        return manifest, read_entry(entry, self.fetch([entry]).__getitem__)


class CheckpointClient:
    """The same calls over one asyncio channel (e.g. `grpc.aio.insecure_channel(address,
    options=CHANNEL_OPTIONS)`)."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float | None = 300.0) -> None:
        self._stub = pb_grpc.CheckpointServiceStub(channel)
        self._timeout = timeout_s

    async def missing(self, chunk_ids: Sequence[str], *, task_id: str = "",
                      attempt: int = 0) -> set[str]:
        absent: set[str] = set()
        with _errors():
            for batch in batches(chunk_ids):
                reply = await self._stub.MissingChunks(pb.MissingChunksRequest(
                    task_id=task_id, attempt=attempt, ids=batch), timeout=self._timeout)
                absent.update(reply.ids)
        return absent

    async def put_chunks(self, task_id: str, attempt: int,
                         chunks: Mapping[str, bytes]) -> PutSummary:
        total = PutSummary(0, 0, 0)
        with _errors():
            for batch in upload_batches(chunks):
                total = added(total, await self._stub.PutChunks(
                    put_requests(task_id, attempt, batch), timeout=self._timeout))
        return total

    async def commit(self, manifest: Manifest) -> Manifest:
        with _errors():
            reply = await self._stub.Commit(pb.CommitRequest(
                task_id=manifest.task_id, attempt=manifest.attempt,
                manifest_json=manifest_json(manifest)), timeout=self._timeout)
        return manifest_from_json(reply.manifest_json)

    async def get_manifest(self, task_id: str, checkpoint_id: str = "") -> Manifest:
        with _errors():
            reply = await self._stub.GetManifest(pb.GetManifestRequest(
                task_id=task_id, checkpoint_id=checkpoint_id), timeout=self._timeout)
        return manifest_from_json(reply.manifest_json)

    async def latest(self, task_id: str) -> Manifest | None:
        try:
            return await self.get_manifest(task_id)
        except CheckpointNotFound:
            return None

    async def list(self, task_id: str = "", run_id: str = "", *,
                   with_removal: bool = False) -> Summaries:
        with _errors():
            reply = await self._stub.List(pb.ListRequest(
                task_id=task_id, run_id=run_id, with_removal=with_removal),
                timeout=self._timeout)
        return [summary_from_proto(s) for s in reply.checkpoints]

    async def read_chunks(self, chunk_ids: Sequence[str]) -> AsyncIterator[tuple[str, bytes]]:
        with _errors():
            for batch in batches(chunk_ids, CHUNKS_PER_READ):
                position = 0
                async for chunk in self._stub.GetChunks(pb.GetChunksRequest(ids=batch),
                                                        timeout=self._timeout):
                    yield verified(chunk, batch[position] if position < len(batch) else "")
                    position += 1
                if position != len(batch):
                    raise CheckpointCorrupt(f"checkpoint-store sent {position} of "
                                            f"{len(batch)} chunks")

    async def delete(self, task_id: str, checkpoint_id: str) -> bool:
        with _errors():
            reply = await self._stub.Delete(pb.DeleteRequest(
                task_id=task_id, checkpoint_id=checkpoint_id), timeout=self._timeout)
        return reply.deleted

    async def put_bytes(self, task_id: str, data: bytes | bytearray | memoryview, *,
                        attempt: int = 0, name: str = "",
                        metadata: Mapping[str, str] | None = None) -> Manifest:
        manifest, chunks = plan_bytes(task_id, data, attempt=attempt, name=name,
                                      metadata=metadata)
        absent = await self.missing(sorted(chunks), task_id=task_id, attempt=attempt)
        await self.put_chunks(task_id, attempt, {k: v for k, v in chunks.items() if k in absent})
        return await self.commit(manifest)

    async def get_bytes(self, task_id: str,
                        checkpoint_id: str = "") -> tuple[Manifest, bytes]:
        manifest = await self.get_manifest(task_id, checkpoint_id)
        entry = blob_entry(manifest)
        chunks = {i: d async for i, d in self.read_chunks(needed_ids([entry]))}
        return manifest, read_entry(entry, chunks.__getitem__)
