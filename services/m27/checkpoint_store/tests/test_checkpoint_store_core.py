"""The checkpoint store over a real chunk directory and an in-memory manifest index:
visibility, dedupe, fencing, fallback on damage, retention and garbage collection."""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from m27.checkpoint_store._chunks import ChunkStore
from m27.checkpoint_store._index import ALL_KEYS, Batch, MemoryManifestIndex
from m27.checkpoint_store._retention import RetentionPolicy
from m27.checkpoint_store._store import CheckpointStore, upload_limit
from m27.common import events
from m27.common.checkpoint_api import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointSummary,
    CheckpointTooLarge,
    ChunkMissing,
    ChunksMissing,
    InvalidCheckpointRequest,
    StaleAttempt,
    summary_from_proto,
    summary_to_proto,
)
from m27.common.checkpoint_format import Manifest, chunk_ids, plan_entry, read_entry

RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
ZSTD = zstandard.ZstdCompressor(level=3)
CHUNK = 64 * 1024


def floats(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def plan(contents: Mapping[str, bytes], previous: Manifest | None = None, *,
         task_id: str = TASK, attempt: int = 0,
         **fields: object) -> tuple[Manifest, dict[str, bytes]]:
    entries, chunks = [], {}
    for name, data in contents.items():
        before = previous.entry(name) if previous else None
        entry, new = plan_entry(name, "tensor", memoryview(data), before, delta=False,
                                compressor=ZSTD, chunk_bytes=CHUNK)
        entries.append(entry)
        chunks.update(new)
    manifest = Manifest(task_id=task_id, attempt=attempt, entries=tuple(entries),
                        **fields)  # type: ignore[arg-type]
    return manifest, chunks


async def stream(chunks: Mapping[str, bytes]) -> AsyncIterator[tuple[str, bytes]]:
    for item in chunks.items():
        await asyncio.sleep(0)
        yield item


async def upload(store: CheckpointStore, contents: Mapping[str, bytes],
                 previous: Manifest | None = None, **fields: object) -> Manifest:
    """What a client does: plan, ask what is missing, send only that, commit."""
    manifest, chunks = plan(contents, previous, **fields)  # type: ignore[arg-type]
    absent = await store.missing(manifest.task_id, manifest.attempt, sorted(chunks))
    await store.put_chunks(manifest.task_id, manifest.attempt,
                           stream({k: chunks[k] for k in absent}))
    return (await store.commit(manifest.task_id, manifest.attempt,
                               msgspec.json.encode(manifest))).manifest


async def restore(store: CheckpointStore, manifest: Manifest) -> dict[str, bytes]:
    wanted = sorted(chunk_ids(manifest))
    got = {i: d async for i, d in store.get_chunks(wanted)}
    return {e.name: read_entry(e, got.__getitem__) for e in manifest.entries}


class Clock:
    def __init__(self, now: float = 1_704_110_400.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(root: Path, *, index: MemoryManifestIndex | None = None,
               **options: object) -> CheckpointStore:
    store = CheckpointStore(ChunkStore(root), index or MemoryManifestIndex(),
                            **options)  # type: ignore[arg-type]
    store.chunks.prepare()
    return store


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return make_store(tmp_path / "root")


async def test_a_committed_checkpoint_restores_byte_for_byte(store: CheckpointStore) -> None:
    contents = {"w": floats(100_000).tobytes(), "b": b"\x00" * 1000}
    committed = await upload(store, contents, name="step-10", step=10, epoch=1,
                             cursor={"offset": 640})
    assert committed.checkpoint_id.startswith("c-")
    assert (committed.seq, committed.step, committed.epoch, committed.cursor) == \
        (1, 10, 1, {"offset": 640})
    assert committed.size_bytes == 401_000
    latest, skipped = await store.get_manifest(TASK)
    assert (latest, skipped) == (committed, [])
    assert await restore(store, latest) == contents


async def test_a_second_checkpoint_sends_only_changed_chunks(store: CheckpointStore) -> None:
    """Most of the weights unchanged: `missing` names only the changed chunks, and
    `new_bytes` counts only their stored bytes."""
    weights = floats(200_000)
    first = await upload(store, {"w": weights.tobytes()})
    assert first.new_bytes == sum(r.stored for r in first.entries[0].chunks)
    changed = weights.copy()
    changed[-100:] += 1.0
    manifest, chunks = plan({"w": changed.tobytes()}, first)
    absent = await store.missing(TASK, 0, sorted(chunks))
    assert len(absent) == 1
    assert len(manifest.entries[0].chunks) == 13
    second = await upload(store, {"w": changed.tobytes()}, first)
    assert second.new_bytes == second.entries[0].chunks[-1].stored
    assert second.new_bytes < first.new_bytes / 10
    assert (await restore(store, second))["w"] == changed.tobytes()


async def test_a_commit_with_chunks_missing_is_refused_and_invisible(
        store: CheckpointStore) -> None:
    manifest, chunks = plan({"w": floats(50_000).tobytes()})
    some = dict(list(chunks.items())[:1])
    await store.put_chunks(TASK, 0, stream(some))
    with pytest.raises(ChunksMissing, match="3 of the checkpoint's 4 chunks are not stored") \
            as caught:
        await store.commit(TASK, 0, msgspec.json.encode(manifest))
    assert set(caught.value.missing) == set(chunks) - set(some)
    assert await store.list(TASK) == []
    with pytest.raises(CheckpointNotFound, match="has no checkpoints"):
        await store.get_manifest(TASK)


async def test_a_manifest_for_another_task_is_refused(store: CheckpointStore) -> None:
    manifest, _ = plan({"w": b"x"}, task_id=f"{RUN}/eval")
    with pytest.raises(InvalidCheckpointRequest, match="the request of"):
        await store.commit(TASK, 0, msgspec.json.encode(manifest))


async def test_stale_attempts_cannot_write(tmp_path: Path) -> None:
    """With the fence at attempt 3, attempt 2 is refused at every writing call; reads and
    attempt 3 work."""
    fence = {"attempt": 3}

    async def assigned(task_id: str) -> int | None:
        return fence["attempt"] if task_id == TASK else None

    store = make_store(tmp_path / "root", assigned_attempt=assigned)
    manifest, chunks = plan({"w": b"state"}, attempt=2)
    with pytest.raises(StaleAttempt, match=f"attempt 2 of {TASK} is stale: attempt 3"):
        await store.missing(TASK, 2, list(chunks))
    with pytest.raises(StaleAttempt):
        await store.put_chunks(TASK, 2, stream(chunks))
    assert list(store.chunks.files()) == []
    assert await store.missing("", 0, list(chunks)) == list(chunks)  # unfenced: no task
    await store.put_chunks(TASK, 3, stream(chunks))
    with pytest.raises(StaleAttempt):
        await store.commit(TASK, 2, msgspec.json.encode(manifest))
    assert await store.list(TASK) == []
    fresh = await upload(store, {"w": b"state"}, attempt=3)
    assert fresh.attempt == 3
    assert (await upload(store, {"w": b"x"}, task_id=f"{RUN}/eval")).attempt == 0


async def test_a_fence_that_moves_during_commit_refuses_it(tmp_path: Path) -> None:
    calls = []

    async def assigned(task_id: str) -> int | None:
        calls.append(task_id)
        return 1 if len(calls) <= 2 else 2  # moves after missing and the first check

    store = make_store(tmp_path / "root", assigned_attempt=assigned)
    manifest, chunks = plan({"w": b"state"}, attempt=1)
    await store.put_chunks(TASK, 1, stream(chunks))
    with pytest.raises(StaleAttempt):
        await store.commit(TASK, 1, msgspec.json.encode(manifest))
    assert await store.list(TASK) == []


async def test_size_limits_apply_to_uploads_and_commits(tmp_path: Path) -> None:
    store = make_store(tmp_path / "root", max_bytes=1000)
    _, chunks = plan({"w": os.urandom(upload_limit(1000) + 1)})
    with pytest.raises(CheckpointTooLarge, match="at most 1000 bytes"):
        await store.put_chunks(TASK, 0, stream(chunks))
    small = await upload(store, {"w": b"x" * 1000})
    assert small.size_bytes == 1000
    big, _ = plan({"w": b"x" * 1001})
    with pytest.raises(CheckpointTooLarge, match="holds 1001"):
        await store.commit(TASK, 0, msgspec.json.encode(big))


async def test_ids_and_seq_follow_commit_order_even_concurrently(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path / "root", clock=clock,
                       retention=RetentionPolicy(keep_last=0))
    results = await asyncio.gather(*(upload(store, {"w": bytes([i]) * 100})
                                     for i in range(12)))
    clock.now -= 5  # a clock stepping back never reorders ids
    results.append(await upload(store, {"w": b"last"}))
    listed = await store.list(TASK)
    assert [s.checkpoint_id for s in listed] == sorted(m.checkpoint_id for m in results)
    assert [s.seq for s in listed] == list(range(1, 14))
    assert listed[-1].checkpoint_id == results[-1].checkpoint_id


async def test_one_checkpoint_by_id_and_unknown_ones(store: CheckpointStore) -> None:
    first = await upload(store, {"w": b"one"})
    await upload(store, {"w": b"two"})
    assert (await store.get_manifest(TASK, first.checkpoint_id))[0] == first
    with pytest.raises(CheckpointNotFound, match="has no checkpoint c-0000000000001-000000"):
        await store.get_manifest(TASK, "c-0000000000001-000000")


class Events:
    def __init__(self) -> None:
        self.seen: list[events.CheckpointCorrupt] = []

    async def __call__(self, event: events.CheckpointCorrupt) -> None:
        self.seen.append(event)


async def test_latest_falls_back_past_a_damaged_checkpoint_with_an_event(
        tmp_path: Path) -> None:
    """A newer checkpoint whose chunk is missing or resized is skipped; the event names it,
    the chunk and the checkpoint handed out instead."""
    seen = Events()
    store = make_store(tmp_path / "root", on_corrupt=seen)
    good = await upload(store, {"w": b"good state" * 1000})
    bad = await upload(store, {"w": b"newer state" * 1000})
    (chunk,) = chunk_ids(bad)
    path = store.chunks.dir.path(chunk)
    path.write_bytes(path.read_bytes()[:-1])
    latest, skipped = await store.get_manifest(TASK)
    assert latest == good
    assert skipped == [bad.checkpoint_id]
    assert [(e.task_id, e.checkpoint_id, e.chunk_id, e.fell_back_to) for e in seen.seen] == \
        [(TASK, bad.checkpoint_id, chunk, good.checkpoint_id)]
    assert "bytes on disk" in seen.seen[0].reason
    path.unlink()
    for good_chunk in chunk_ids(good):
        store.chunks.dir.path(good_chunk).unlink()
    with pytest.raises(CheckpointCorrupt, match=r"every checkpoint of .* has missing"):
        await store.get_manifest(TASK)
    assert [e.fell_back_to for e in seen.seen[1:]] == ["", ""]


async def test_a_bit_flip_ends_get_chunks_then_latest_falls_back(tmp_path: Path) -> None:
    """Same size, different bytes: only reading finds it. The stream ends at that chunk,
    the chunk is quarantined, and the next `latest` skips the damaged checkpoint."""
    seen = Events()
    store = make_store(tmp_path / "root", on_corrupt=seen)
    good = await upload(store, {"w": floats(50_000, seed=1).tobytes()})
    bad = await upload(store, {"w": floats(50_000, seed=2).tobytes()})
    ids = [r.id for r in bad.entries[0].chunks]
    path = store.chunks.dir.path(ids[2])
    damaged = bytearray(path.read_bytes())
    damaged[7] ^= 0x10
    path.write_bytes(bytes(damaged))
    received = []

    async def read() -> None:
        async for chunk_id, _ in store.get_chunks(ids):
            received.append(chunk_id)

    with pytest.raises(CheckpointCorrupt, match=f"chunk {ids[2]} is corrupt"):
        await read()
    assert received == ids[:2]
    latest, skipped = await store.get_manifest(TASK)
    assert (latest.checkpoint_id, skipped) == (good.checkpoint_id, [bad.checkpoint_id])
    assert seen.seen[0].chunk_id == ids[2]
    with pytest.raises(ChunkMissing):
        async for _ in store.get_chunks([ids[2]]):
            pass


async def test_retention_keeps_the_last_n_and_every_mth(tmp_path: Path) -> None:
    store = make_store(tmp_path / "root", retention=RetentionPolicy(keep_last=2, keep_every=3))
    committed = [await upload(store, {"w": bytes([i]) * 50}) for i in range(7)]
    assert [s.seq for s in await store.list(TASK)] == [3, 6, 7]
    other = await upload(store, {"w": b"other"}, task_id=f"{RUN}/eval")
    assert [s.checkpoint_id for s in await store.list(f"{RUN}/eval")] == [other.checkpoint_id]
    assert len(await store.list(run_id=RUN)) == 4
    assert committed[-1].seq == 7


async def test_gc_removes_only_unreferenced_chunks_past_the_grace_period(
        tmp_path: Path) -> None:
    """Chunks only retired checkpoints used go once old; chunks a kept checkpoint uses (an
    unchanged one shared with a retired checkpoint included) and fresh uploads stay."""
    store = make_store(tmp_path / "root", retention=RetentionPolicy(keep_last=1),
                       gc_grace_s=3600)
    shared = floats(20_000, seed=5).tobytes()
    old = await upload(store, {"shared": shared, "w": b"old" * 100})
    new = await upload(store, {"shared": shared, "w": b"new" * 100}, old)
    assert [s.checkpoint_id for s in await store.list(TASK)] == [new.checkpoint_id]
    _, pending = plan({"w": b"being uploaded"})
    await store.put_chunks(TASK, 0, stream(pending))
    retired = chunk_ids(old) - chunk_ids(new)
    assert len(retired) == 1
    long_ago = time.time() - 7200
    for chunk in store.chunks.files():
        os.utime(store.chunks.dir.path(chunk.id), (long_ago, long_ago))
    (young,) = pending
    os.utime(store.chunks.dir.path(young))
    report = await store.collect_garbage()
    assert (report.deleted, report.referenced, report.young) == (1, len(chunk_ids(new)), 1)
    remaining = {c.id for c in store.chunks.files()}
    assert remaining == chunk_ids(new) | {young}
    assert await restore(store, new) == {"shared": shared, "w": b"new" * 100}


async def test_a_finished_runs_checkpoints_go_keep_finished_after_it_ended(
        tmp_path: Path) -> None:
    """A run that ended more than keep_finished ago loses its checkpoints (protected ones
    too) and the chunks only they used; a run still going, one that ended recently and one
    the store cannot find keep theirs, and so does a chunk another run shares."""
    clock = Clock(time.time())  # the chunk files' times are real ones
    other_run, unknown_run = "r-20240101-120000-def456", "r-20240101-120000-0a0b0c"
    ended_at = clock.now - 7 * 86400
    ended: dict[str, float | None] = {RUN: ended_at, other_run: None}
    asked: list[str] = []

    async def run_ended(run_id: str) -> float | None:
        asked.append(run_id)
        return ended.get(run_id)

    store = make_store(tmp_path / "root", clock=clock, gc_grace_s=0,
                       keep_finished_s=86400, run_ended=run_ended)
    shared = floats(5_000, seed=1).tobytes()
    first = await upload(store, {"shared": shared, "w": b"old run" * 50}, step=1)
    await upload(store, {"shared": shared, "w": b"old run, later" * 50}, first, step=2)
    assert await store.protect(TASK, 0, 2, 0.0, "a NaN") == first.checkpoint_id
    going = await upload(store, {"shared": shared, "w": b"still going" * 50},
                         task_id=f"{other_run}/train")
    unknown = await upload(store, {"w": b"whose?" * 50}, task_id=f"{unknown_run}/train")
    asked.clear()
    listed = await store.list(task_id=TASK)  # the agent's listing: no run record read
    assert [s.removed_at for s in listed] == [None, None]
    assert asked == []
    listed = await store.list(run_id=RUN, with_removal=True)  # `m27 checkpoints`'s
    assert [s.removed_at for s in listed] == [ended_at + 86400] * 2
    assert [s.removed_at for s in await store.list(run_id=other_run, with_removal=True)
            ] == [None]
    asked.clear()
    clock.now += 1
    report = await store.collect_garbage()
    assert report.expired == 2
    assert report.manifests == 4
    assert await store.list(run_id=RUN) == []
    assert sorted(asked) == sorted([RUN, other_run, unknown_run])  # once per run and round
    kept = chunk_ids(going) | chunk_ids(unknown)
    assert {c.id for c in store.chunks.files()} == kept
    assert await restore(store, going) == {"shared": shared, "w": b"still going" * 50}

    ended[other_run] = clock.now - 3600  # ended an hour ago: kept for a day
    assert (await store.collect_garbage()).expired == 0
    clock.now += 86400
    assert (await store.collect_garbage()).expired == 1
    assert {c.id for c in store.chunks.files()} == chunk_ids(unknown)


async def test_a_run_known_to_have_ended_is_asked_about_again_only_when_due(
        tmp_path: Path) -> None:
    """A run's record can be megabytes: GC reads it once it ended and then only when its
    checkpoints fall due — afresh, since a retry may have reopened the run, whose
    checkpoints then stay."""
    clock = Clock(time.time())
    ended: dict[str, float | None] = {RUN: clock.now}
    asked: list[str] = []

    async def run_ended(run_id: str) -> float | None:
        asked.append(run_id)
        return ended[run_id]

    store = make_store(tmp_path / "root", clock=clock, gc_grace_s=0, keep_finished_s=100,
                       run_ended=run_ended)
    await upload(store, {"w": b"kept until due" * 10})
    for _ in range(3):
        assert (await store.collect_garbage()).expired == 0
    assert len(asked) == 1  # known to have ended: not read again before it is due
    ended[RUN] = None  # retried meanwhile: going again
    clock.now += 100
    assert (await store.collect_garbage()).expired == 0
    assert (await store.collect_garbage()).expired == 0
    assert len(asked) == 3  # due: read afresh; going: read every round
    ended[RUN] = clock.now  # the retry ended
    assert (await store.collect_garbage()).expired == 0
    clock.now += 100
    assert (await store.collect_garbage()).expired == 1
    assert await store.list(TASK) == []


@given(removed_at=st.none() | st.floats(min_value=0, max_value=4e9),
       step=st.none() | st.integers(min_value=0, max_value=2**62))
def test_a_summary_crosses_the_wire_unchanged(removed_at: float | None,
                                              step: int | None) -> None:
    summary = CheckpointSummary(
        task_id=TASK, checkpoint_id="c-0000000000001-aaaaaa", attempt=2, name="n", step=step,
        epoch=None, created_at=1.5, size_bytes=10, new_bytes=3, full=True, entries=1, seq=4,
        metadata={"kind": "files"}, protected="why", removed_at=removed_at)
    assert summary_from_proto(summary_to_proto(summary)) == summary


async def test_keep_finished_zero_keeps_every_finished_run(tmp_path: Path) -> None:
    async def long_ago(run_id: str) -> float | None:
        return 0.0

    store = make_store(tmp_path / "root", gc_grace_s=0, keep_finished_s=0,
                       run_ended=long_ago)
    manifest = await upload(store, {"w": b"kept" * 10})
    assert (await store.collect_garbage()).expired == 0
    assert [s.checkpoint_id for s in await store.list(TASK)] == [manifest.checkpoint_id]


class _Batch(list[Manifest]):
    """A batch that can be watched (a plain list takes no weak reference)."""


class WatchedIndex(MemoryManifestIndex):
    """Yields small batches and records how many earlier ones were still alive whenever
    the next one was asked for; a listing of everything at once is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.alive_at_next: list[int] = []

    async def list(self, pattern: str, *, strict: bool = False) -> list[Manifest]:
        assert pattern != ALL_KEYS, "garbage collection must read a batch at a time"
        return await super().list(pattern, strict=strict)

    async def batches(self, pattern: str, *,
                      strict: bool = False) -> AsyncIterator[Batch]:
        found = await super().list(pattern, strict=strict)
        given: list[weakref.ref[_Batch]] = []
        for start in range(0, len(found), 2):
            batch = _Batch(found[start:start + 2])
            self.alive_at_next.append(sum(ref() is not None for ref in given))
            given.append(weakref.ref(batch))
            yield batch
            del batch


async def test_garbage_collection_holds_one_batch_of_manifests_at_a_time(
        tmp_path: Path) -> None:
    """Found by the soak: a round held every manifest the store keeps at once, so the
    store's memory grew with every checkpoint it kept."""
    index = WatchedIndex()
    store = make_store(tmp_path / "root", index=index, gc_grace_s=0)
    tasks = [f"r-20240101-120000-{i:06x}/train" for i in range(7)]
    kept = [await upload(store, {"w": task.encode() * 30}, task_id=task) for task in tasks]
    await store.put_chunks(TASK, 0, stream(plan({"w": b"orphan"})[1]))
    report = await store.collect_garbage()
    assert (report.manifests, report.deleted) == (7, 1)
    assert len(index.alive_at_next) == 4
    assert max(index.alive_at_next) <= 1
    assert {c.id for c in store.chunks.files()} == set().union(*map(chunk_ids, kept))


async def test_an_unreadable_manifest_stops_the_sweep(tmp_path: Path) -> None:
    index = MemoryManifestIndex()
    store = make_store(tmp_path / "root", index=index, gc_grace_s=0)
    await store.put_chunks(TASK, 0, stream(plan({"w": b"orphan"})[1]))
    index.values[f"{RUN}.train.c-0000000000001-aaaaaa"] = b"{garbage"
    with pytest.raises(CheckpointCorrupt, match="unreadable"):
        await store.collect_garbage()
    assert len(list(store.chunks.files())) == 1
    assert await store.list(TASK) == []  # a listing skips it instead


async def test_a_cancelled_upload_leaves_no_temp_file(store: CheckpointStore) -> None:
    started = asyncio.Event()

    async def slow() -> AsyncIterator[tuple[str, bytes]]:
        _, chunks = plan({"w": floats(40_000).tobytes()})
        for item in chunks.items():
            yield item
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(store.put_chunks(TASK, 0, slow()))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    leftovers = [p for p in store.chunks.dir.root.rglob("*") if p.is_file()
                 and p.name.startswith(".tmp-")]
    assert leftovers == []


async def test_delete_forgets_a_checkpoint(store: CheckpointStore) -> None:
    keep = await upload(store, {"w": b"keep"})
    gone = await upload(store, {"w": b"gone"})
    assert await store.delete(TASK, gone.checkpoint_id) is True
    assert await store.delete(TASK, gone.checkpoint_id) is False
    assert [s.checkpoint_id for s in await store.list(TASK)] == [keep.checkpoint_id]
    with pytest.raises(InvalidCheckpointRequest, match="checkpoint_id is required"):
        await store.delete(TASK, "")


@pytest.mark.parametrize("task_id", ["../../etc", "r-x/../y", "/etc/passwd", f"{TASK}/x"])
async def test_hostile_task_ids_are_invalid_everywhere(store: CheckpointStore,
                                                       task_id: str) -> None:
    manifest, chunks = plan({"w": b"x"})
    calls = [store.get_manifest(task_id), store.list(task_id),
             store.delete(task_id, "c-1704110400000-0a1b2c"),
             store.missing(task_id, 0, list(chunks)),
             store.put_chunks(task_id, 0, stream(chunks)),
             store.commit(task_id, 0, msgspec.json.encode(manifest))]
    for call in calls:
        with pytest.raises(InvalidCheckpointRequest):
            await call
    assert list(store.chunks.files()) == []


async def test_list_takes_exactly_one_of_task_and_run(store: CheckpointStore) -> None:
    for args in [("", ""), (TASK, RUN)]:
        with pytest.raises(InvalidCheckpointRequest, match="exactly one"):
            await store.list(*args)
    with pytest.raises(InvalidCheckpointRequest, match="run_id must look like"):
        await store.list(run_id="r-*")


async def test_each_commit_is_announced_and_an_announcement_failure_keeps_it(
        tmp_path: Path) -> None:
    """The scheduler learns when a task last checkpointed (least work lost on preemption);
    the checkpoint is durable before that, so a failed announcement does not undo it."""
    seen: list[events.CheckpointCommitted] = []

    async def announce(event: events.CheckpointCommitted) -> None:
        seen.append(event)
        if len(seen) == 2:
            raise TimeoutError("NATS is away")

    store = make_store(tmp_path / "root", on_commit=announce)
    first = await upload(store, {"w": b"x" * 5000}, step=10)
    second = await upload(store, {"w": b"y" * 5000}, first, step=20)
    assert [(e.task_id, e.checkpoint_id, e.step) for e in seen] == [
        (TASK, first.checkpoint_id, 10), (TASK, second.checkpoint_id, 20)]
    assert seen[0].size_bytes == 5000
    assert (await store.get_manifest(TASK))[0] == second  # committed all the same


async def test_the_last_checkpoint_before_an_anomaly_outlives_retention(
        tmp_path: Path) -> None:
    """Protect picks the newest checkpoint taken before the anomaly's training step and
    keeps it through every later commit; a commit cannot protect itself."""
    store = make_store(tmp_path / "root", retention=RetentionPolicy(keep_last=2))
    for step in (100, 200, 300):
        await upload(store, {"w": bytes([step % 251]) * 50}, step=step)
    chosen = await store.protect(TASK, 0, 250, 0.0, "training anomaly: loss spike\nat 250")
    assert chosen == next(s for s in await store.list(TASK) if s.step == 200).checkpoint_id
    for step in (400, 500, 600):  # retention now keeps the last 2 and the protected one
        await upload(store, {"w": bytes([step % 251]) * 50}, step=step, protected="mine")
    listed = await store.list(TASK)
    assert [(s.step, s.protected) for s in listed] == [
        (200, "training anomaly: loss spike at 250"), (500, ""), (600, "")]
    assert await store.protect(TASK, 0, 50, 0.0, "before everything") == ""
    # a second anomaly keeps the first one's reason on the same checkpoint
    assert await store.protect(TASK, 0, 260, 0.0, "again") == chosen
    assert (await store.list(TASK))[0].protected == "training anomaly: loss spike at 250"


async def test_protect_is_fenced_like_a_commit(tmp_path: Path) -> None:
    async def assigned(task_id: str) -> int | None:
        return 3

    store = make_store(tmp_path / "root", assigned_attempt=assigned)
    with pytest.raises(StaleAttempt):
        await store.protect(TASK, 2, 10, 0.0, "stale")
