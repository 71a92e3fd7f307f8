"""The checkpoint store over real files and an in-memory index: order, visibility, integrity."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest

from m27.checkpoint_store._blobs import TEMP_DIR, FileBlobStore
from m27.checkpoint_store._errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointTooLarge,
    InvalidCheckpointRequest,
    StorageError,
    StorageUnavailable,
)
from m27.checkpoint_store._index import MemoryRecordIndex
from m27.checkpoint_store._model import CheckpointRecord, Header
from m27.checkpoint_store._store import CheckpointStore

RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
HEADER = Header(run_id=RUN, step="train", attempt=1, name="epoch-1", metadata={"epoch": "1"})


class Clock:
    """A settable clock: ids and created_at come from it."""

    def __init__(self, now: float = 1_704_110_400.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FailingIndex(MemoryRecordIndex):
    async def put(self, record: CheckpointRecord) -> None:
        raise StorageUnavailable("cannot commit a checkpoint record: NATS KV: down")


async def parts(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


def make_store(root: Path, index: MemoryRecordIndex | None = None, *, max_bytes: int = 1 << 30,
               clock: Clock | None = None) -> CheckpointStore:
    return CheckpointStore(FileBlobStore(root), index or MemoryRecordIndex(),
                           max_bytes=max_bytes, clock=clock or Clock())


async def read_all(store: CheckpointStore, task_id: str, checkpoint_id: str = "",
                   chunk_bytes: int = 1 << 20) -> tuple[CheckpointRecord, list[bytes]]:
    async with await store.open(task_id, checkpoint_id) as got:
        return got.record, [chunk async for chunk in got.chunks(chunk_bytes)]


def blob_file(root: Path, record: CheckpointRecord) -> Path:
    return root.joinpath(*record.ref.blob_parts)


@pytest.fixture
async def store(tmp_path: Path) -> CheckpointStore:
    store = make_store(tmp_path / "root")
    await store.recover()
    return store


async def test_put_then_get_returns_the_same_bytes(store: CheckpointStore) -> None:
    """Bytes sent in uneven parts come back identical, with their size and sha256."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    pieces = [data[i:i + 300_000] for i in range(0, len(data), 300_000)]
    record = await store.put(HEADER, parts(*pieces))
    assert record.size_bytes == len(data)
    assert record.sha256 == hashlib.sha256(data).hexdigest()
    assert (record.task_id, record.attempt, record.name) == (TASK, 1, "epoch-1")
    assert record.metadata == {"epoch": "1"}
    got, chunks = await read_all(store, TASK, record.checkpoint_id)
    assert got == record
    assert b"".join(chunks) == data
    assert [len(c) for c in chunks] == [1 << 20, 1 << 20, 1 << 20, 17]


async def test_an_empty_checkpoint_is_allowed(store: CheckpointStore) -> None:
    record = await store.put(HEADER, parts())
    assert record.size_bytes == 0
    assert (await read_all(store, TASK))[1] == []


async def test_list_is_oldest_first_and_latest_is_the_newest(tmp_path: Path) -> None:
    """Ids sort by commit time, even within one millisecond or when the clock steps back."""
    clock = Clock()
    store = make_store(tmp_path / "root", clock=clock)
    await store.recover()
    ids = []
    for step_back, payload in [(0.0, b"one"), (0.0, b"two"), (-5.0, b"three")]:
        clock.now += step_back
        ids.append((await store.put(HEADER, parts(payload))).checkpoint_id)
    assert [r.checkpoint_id for r in await store.list(TASK)] == ids
    assert sorted(ids) == ids
    assert len(set(ids)) == 3
    latest, chunks = await read_all(store, TASK)
    assert latest.checkpoint_id == ids[-1]
    assert chunks == [b"three"]
    other = Header(run_id=RUN, step="eval", attempt=0)
    await store.put(other, parts(b"other task"))
    assert len(await store.list(TASK)) == 3


async def test_concurrent_puts_get_unique_ordered_ids(store: CheckpointStore) -> None:
    """Many Puts of one task at the same instant: all stored, all distinct, all listed."""
    records = await asyncio.gather(*(store.put(HEADER, parts(bytes([i]) * 1000))
                                     for i in range(20)))
    ids = [r.checkpoint_id for r in records]
    assert len(set(ids)) == 20
    assert [r.checkpoint_id for r in await store.list(TASK)] == sorted(ids)
    for record in records:
        _, chunks = await read_all(store, TASK, record.checkpoint_id)
        assert hashlib.sha256(b"".join(chunks)).hexdigest() == record.sha256


async def test_created_at_is_the_commit_time(tmp_path: Path) -> None:
    store = make_store(tmp_path / "root", clock=Clock(1_704_110_400.123))
    await store.recover()
    record = await store.put(HEADER, parts(b"x"))
    assert record.created_at == pytest.approx(1_704_110_400.123)
    assert record.checkpoint_id.startswith("c-1704110400123-")


async def test_unknown_checkpoints_are_not_found(store: CheckpointStore) -> None:
    with pytest.raises(CheckpointNotFound, match="has no checkpoints"):
        await store.open(TASK)
    with pytest.raises(CheckpointNotFound, match="has no checkpoint c-"):
        await store.open(TASK, "c-1704110400000-0a1b2c")
    assert await store.list(TASK) == []


@pytest.mark.parametrize("task_id", ["../../etc", "r-x/../y", "/etc/passwd", f"{TASK}/x"])
async def test_hostile_task_ids_are_invalid_everywhere(store: CheckpointStore,
                                                       task_id: str) -> None:
    with pytest.raises(InvalidCheckpointRequest):
        await store.open(task_id)
    with pytest.raises(InvalidCheckpointRequest):
        await store.list(task_id)
    with pytest.raises(InvalidCheckpointRequest):
        await store.delete(task_id, "c-1704110400000-0a1b2c")


@pytest.mark.parametrize("position", [0, 1 << 20, (2 << 20) + 5])
async def test_a_flipped_byte_is_detected_and_the_last_chunk_withheld(
        tmp_path: Path, store: CheckpointStore, position: int) -> None:
    """Corruption anywhere ends the stream with CheckpointCorrupt before the final chunk."""
    data = os.urandom((2 << 20) + 10)
    record = await store.put(HEADER, parts(data))
    path = blob_file(tmp_path / "root", record)
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))
    received: list[bytes] = []

    async def consume() -> None:
        async with await store.open(TASK, record.checkpoint_id) as got:
            async for chunk in got.chunks():
                received.append(chunk)

    with pytest.raises(CheckpointCorrupt, match="sha256 does not match"):
        await consume()
    assert sum(map(len, received)) == 2 << 20  # never the whole blob


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b[:-1], "bytes on disk"),
    (lambda b: b + b"!", "bytes on disk"),
])
async def test_a_resized_blob_is_corrupt_before_any_byte(
        tmp_path: Path, store: CheckpointStore, change: Callable[[bytes], bytes],
        message: str) -> None:
    record = await store.put(HEADER, parts(b"0123456789"))
    path = blob_file(tmp_path / "root", record)
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(CheckpointCorrupt, match=message):
        await store.open(TASK, record.checkpoint_id)


async def test_a_vanished_blob_with_a_record_is_data_loss(tmp_path: Path,
                                                          store: CheckpointStore) -> None:
    record = await store.put(HEADER, parts(b"data"))
    blob_file(tmp_path / "root", record).unlink()
    with pytest.raises(CheckpointCorrupt, match="missing from disk"):
        await store.open(TASK, record.checkpoint_id)


async def test_a_checkpoint_deleted_while_opening_is_not_found(tmp_path: Path) -> None:
    """Delete removes the record first: a reader racing it sees NOT_FOUND, not DATA_LOSS."""
    index = MemoryRecordIndex()
    store = make_store(tmp_path / "root", index)
    await store.recover()
    record = await store.put(HEADER, parts(b"data"))
    original_find = store.find

    async def find_then_delete(task_id: str, checkpoint_id: str) -> CheckpointRecord:
        found = await original_find(task_id, checkpoint_id)
        await store.delete(task_id, found.checkpoint_id)
        return found

    store.find = find_then_delete  # type: ignore[method-assign]
    with pytest.raises(CheckpointNotFound):
        await store.open(TASK, record.checkpoint_id)


async def test_too_large_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path / "root", max_bytes=10)
    await store.recover()
    assert (await store.put(HEADER, parts(b"12345", b"67890"))).size_bytes == 10
    with pytest.raises(CheckpointTooLarge, match="at most 10 bytes"):
        await store.put(HEADER, parts(b"12345", b"678901"))
    assert len(await store.list(TASK)) == 1
    assert os.listdir(tmp_path / "root" / TEMP_DIR) == []


async def test_a_failed_stream_commits_nothing(tmp_path: Path, store: CheckpointStore) -> None:
    """A Put whose client fails mid-stream leaves the previous checkpoint the latest."""
    first = await store.put(HEADER, parts(b"good"))

    async def broken() -> AsyncIterator[bytes]:
        yield b"half"
        raise InvalidCheckpointRequest("Put message 2 carries neither header nor data")

    with pytest.raises(InvalidCheckpointRequest):
        await store.put(HEADER, broken())
    assert [r.checkpoint_id for r in await store.list(TASK)] == [first.checkpoint_id]
    assert os.listdir(tmp_path / "root" / TEMP_DIR) == []


async def test_a_cancelled_put_leaves_no_temp_file(tmp_path: Path,
                                                   store: CheckpointStore) -> None:
    started = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"x" * (2 << 20)
        started.set()
        await asyncio.sleep(60)
        yield b"never"

    task = asyncio.create_task(store.put(HEADER, slow()))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert os.listdir(tmp_path / "root" / TEMP_DIR) == []
    assert await store.list(TASK) == []


async def test_no_record_means_no_checkpoint(tmp_path: Path) -> None:
    """If the record cannot be committed the Put fails and nothing becomes visible."""
    store = make_store(tmp_path / "root", FailingIndex())
    await store.recover()
    with pytest.raises(StorageUnavailable):
        await store.put(HEADER, parts(b"data"))
    assert await store.list(TASK) == []


async def test_delete_removes_record_then_file(tmp_path: Path) -> None:
    index = MemoryRecordIndex()
    store = make_store(tmp_path / "root", index)
    await store.recover()
    keep = await store.put(HEADER, parts(b"keep"))
    gone = await store.put(HEADER, parts(b"gone"))
    assert await store.delete(TASK, gone.checkpoint_id) is True
    assert not blob_file(tmp_path / "root", gone).exists()
    assert gone.ref.key not in index.values
    assert [r.checkpoint_id for r in await store.list(TASK)] == [keep.checkpoint_id]
    assert await store.delete(TASK, gone.checkpoint_id) is False
    with pytest.raises(InvalidCheckpointRequest, match="checkpoint_id is required"):
        await store.delete(TASK, "")


async def test_delete_also_clears_an_orphan_blob(tmp_path: Path) -> None:
    """A crash between the two steps of Delete leaves a file; a retried Delete removes it."""
    index = MemoryRecordIndex()
    store = make_store(tmp_path / "root", index)
    await store.recover()
    record = await store.put(HEADER, parts(b"data"))
    await index.delete(record.ref)
    assert await store.delete(TASK, record.checkpoint_id) is False
    assert not blob_file(tmp_path / "root", record).exists()


async def test_an_unknown_layout_is_refused(tmp_path: Path) -> None:
    index = MemoryRecordIndex()
    store = make_store(tmp_path / "root", index)
    await store.recover()
    record = await store.put(HEADER, parts(b"data"))
    await index.put(msgspec.structs.replace(record, layout="chunked-zstd"))
    with pytest.raises(StorageError, match="cannot read"):
        await store.open(TASK, record.checkpoint_id)
