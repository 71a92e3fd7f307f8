"""The checkpoint store: blobs on disk plus records in the index, in the order that is safe.

Put: bytes → temp file → fsync → rename → fsync dir, and only then the record; so a
checkpoint is visible only once it is whole, and a crash mid-write leaves the previous one
intact. Delete: record first, then the file; so a half-done Delete never leaves a visible
checkpoint without bytes. Get verifies size and sha256 while streaming and holds back the
last chunk until both match, so a reader never receives a complete-looking corrupt blob.
Blocking file I/O runs in threads; the event loop only waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Final

from m27.checkpoint_store._blobs import BlobReader, BlobStore, BlobWriter
from m27.checkpoint_store._errors import (
    BlobMissing,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointTooLarge,
    StaleAttempt,
    StorageError,
)
from m27.checkpoint_store._ids import (
    CheckpointRef,
    checkpoint_id_ms,
    new_checkpoint_id,
    next_id_ms,
    parse_ref,
    parse_task_id,
)
from m27.checkpoint_store._index import RecordIndex
from m27.checkpoint_store._model import CheckpointRecord, Header
from m27.common.logging import get_logger

log = get_logger()

DEFAULT_MAX_BYTES: Final = 64 * 1024**3
READ_CHUNK_BYTES: Final = 1024 * 1024
WRITE_BUFFER_BYTES: Final = 1024 * 1024


def _token() -> str:
    return secrets.token_hex(3)


class CheckpointStore:
    """Put, Get, List and Delete over a `BlobStore` and a `RecordIndex`."""

    def __init__(self, blobs: BlobStore, index: RecordIndex, *,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.time,
                 token: Callable[[], str] = _token,
                 assigned_attempt: Callable[[str], Awaitable[int | None]] | None = None) -> None:
        self._assigned_attempt = assigned_attempt
        self._blobs = blobs
        self._index = index
        self.max_bytes = max_bytes
        self._clock = clock
        self._token = token
        self._last_ms = 0

    async def _check_attempt(self, header: Header) -> None:
        """Fencing: only the attempt the scheduler assigned (or a newer one) may write."""
        if self._assigned_attempt is None:
            return
        assigned = await self._assigned_attempt(header.task_id)
        if assigned is not None and header.attempt < assigned:
            raise StaleAttempt(f"attempt {header.attempt} of {header.task_id} is stale: "
                               f"attempt {assigned} is the assigned one")

    async def recover(self) -> int:
        """Clean what a crash left behind; run once before serving."""
        return await asyncio.to_thread(self._blobs.recover)

    async def put(self, header: Header, parts: AsyncIterable[bytes]) -> CheckpointRecord:
        """Store the bytes of `parts` as a new checkpoint of the header's task."""
        await self._check_attempt(header)
        writer = await asyncio.to_thread(self._blobs.create)
        try:
            await self._receive(writer, parts)
            await self._check_attempt(header)  # the task may have moved during the upload
            ref = self._new_ref(header)
            digest = await asyncio.to_thread(writer.commit, ref)
        except BaseException:
            writer.abort()  # not in a thread: it must also run when the RPC is cancelled
            raise
        record = CheckpointRecord(
            task_id=header.task_id, checkpoint_id=ref.checkpoint_id, attempt=header.attempt,
            name=header.name, size_bytes=digest.size_bytes, sha256=digest.sha256,
            created_at=checkpoint_id_ms(ref.checkpoint_id) / 1000, metadata=header.metadata,
            layout=self._blobs.layout)
        try:
            await self._index.put(record)
        except BaseException:
            # The record may have been committed with only its ack lost: keep the blob, an
            # orphan costs disk space but a record without bytes would be data loss.
            log.warning("checkpoint.record_not_committed", task_id=header.task_id,
                        checkpoint_id=ref.checkpoint_id)
            raise
        return record

    async def _receive(self, writer: BlobWriter, parts: AsyncIterable[bytes]) -> None:
        """Write `parts` in ~1 MiB batches, refusing to go past `max_bytes`."""
        buffer = bytearray()
        total = 0
        async for part in parts:
            total += len(part)
            if total > self.max_bytes:
                raise CheckpointTooLarge(
                    f"a checkpoint may be at most {self.max_bytes} bytes; this one is larger")
            buffer += part
            if len(buffer) >= WRITE_BUFFER_BYTES:
                batch, buffer = buffer, bytearray()
                await asyncio.to_thread(writer.write, batch)
        if buffer:
            await asyncio.to_thread(writer.write, buffer)

    def _new_ref(self, header: Header) -> CheckpointRef:
        self._last_ms = next_id_ms(int(self._clock() * 1000), self._last_ms)
        checkpoint_id = new_checkpoint_id(self._last_ms, self._token())
        return CheckpointRef(header.run_id, header.step, checkpoint_id)

    async def list(self, task_id: str) -> list[CheckpointRecord]:
        """A task's committed checkpoints, oldest first."""
        run_id, step = parse_task_id(task_id)
        records = await self._index.list(run_id, step)
        return sorted(records, key=lambda r: r.checkpoint_id)

    async def find(self, task_id: str, checkpoint_id: str) -> CheckpointRecord:
        """One committed checkpoint; an empty id means the task's latest."""
        if not checkpoint_id:
            records = await self.list(task_id)
            if not records:
                raise CheckpointNotFound(f"task {task_id} has no checkpoints")
            return records[-1]
        ref = parse_ref(task_id, checkpoint_id)
        record = await self._index.get(ref)
        if record is None:
            raise CheckpointNotFound(f"task {task_id} has no checkpoint {checkpoint_id}")
        return record

    async def open(self, task_id: str, checkpoint_id: str = "") -> OpenCheckpoint:
        """A checkpoint ready to stream: its record is committed and its blob is open."""
        record = await self.find(task_id, checkpoint_id)
        if record.layout != self._blobs.layout:
            raise StorageError(f"checkpoint {record.checkpoint_id} is stored as "
                               f"{record.layout!r}, which this store cannot read")
        try:
            reader = await asyncio.to_thread(self._blobs.open, record.ref)
        except BlobMissing:
            if await self._index.get(record.ref) is None:  # deleted since we looked
                raise CheckpointNotFound(
                    f"task {task_id} has no checkpoint {record.checkpoint_id}") from None
            raise CheckpointCorrupt(f"the bytes of checkpoint {record.checkpoint_id} of "
                                    f"{task_id} are missing from disk") from None
        opened = OpenCheckpoint(record, reader)
        if reader.size != record.size_bytes:
            opened.close()
            raise opened.corrupt(f"{reader.size} bytes on disk, {record.size_bytes} recorded")
        return opened

    async def delete(self, task_id: str, checkpoint_id: str) -> bool:
        """Remove one checkpoint; False when it did not exist (a retry is harmless)."""
        ref = parse_ref(task_id, checkpoint_id)
        existed = await self._index.get(ref) is not None
        await self._index.delete(ref)
        removed = await asyncio.to_thread(self._blobs.delete, ref)
        if removed and not existed:
            log.info("checkpoint.orphan_removed", task_id=task_id, checkpoint_id=checkpoint_id)
        return existed


class OpenCheckpoint:
    """A committed checkpoint with its blob open; `chunks()` streams and verifies it."""

    def __init__(self, record: CheckpointRecord, reader: BlobReader) -> None:
        self.record = record
        self._reader = reader

    async def __aenter__(self) -> OpenCheckpoint:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Closing a read-only fd does not wait on the disk, and must run on cancel too."""
        self._reader.close()

    def corrupt(self, detail: str) -> CheckpointCorrupt:
        record = self.record
        log.error("checkpoint.corrupt", task_id=record.task_id,
                  checkpoint_id=record.checkpoint_id, detail=detail)
        return CheckpointCorrupt(f"checkpoint {record.checkpoint_id} of {record.task_id} is "
                                 f"corrupt on disk ({detail}); its bytes cannot be trusted")

    async def chunks(self, chunk_bytes: int = READ_CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The blob's bytes in order; CheckpointCorrupt instead of the last chunk on a
        mismatch of size or sha256."""
        hasher = hashlib.sha256()
        held: bytes | None = None
        total = 0
        while chunk := await asyncio.to_thread(_read_hashed, self._reader, hasher, chunk_bytes):
            total += len(chunk)
            if total > self.record.size_bytes:
                raise self.corrupt(f"more than the recorded {self.record.size_bytes} bytes")
            if held is not None:
                yield held
            held = chunk
        if total != self.record.size_bytes:
            raise self.corrupt(f"{total} bytes read, {self.record.size_bytes} recorded")
        if hasher.hexdigest() != self.record.sha256:
            raise self.corrupt("sha256 does not match the record")
        if held is not None:
            yield held


def _read_hashed(reader: BlobReader, hasher: hashlib._Hash, n: int) -> bytes:
    """Read and hash in the same worker thread: hashing 1 MiB must not stall the loop."""
    chunk = reader.read(n)
    hasher.update(chunk)
    return chunk
