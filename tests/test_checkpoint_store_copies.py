"""Two checkpoint-store processes on one checkpoint directory and one NATS, as a rolling
update or `replicas: 2` runs them (docs/reliability.md, "Two copies of a service"): each
serves what the other stored, their garbage collections never remove a chunk a kept
checkpoint needs, one dying mid-upload costs nothing committed, and both refuse stale
attempts. The orderings one copy's task lock cannot give across copies are unit-tested in
`m27/checkpoint_store/tests/test_two_copies.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import nats.js.errors
import pytest
import zstandard

from m27.checkpoint_store import KvManifestIndex
from m27.checkpoint_store._ids import CheckpointRef
from m27.checkpoint_store._index import ALL_KEYS
from m27.client.checkpoints import CHANNEL_OPTIONS, CheckpointClient, RemoteStore
from m27.common import subjects
from m27.common.api_auth import default_access
from m27.common.bus import NatsBus, ensure_topology
from m27.common.checkpoint_api import StaleAttempt
from m27.common.checkpoint_format import Manifest, chunk_ids, plan_entry, read_entry
from m27.common.checkpoint_storage import TMP_PREFIX
from m27.common.model import Fence
from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import ServiceProcess
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc
from tests.support import service_log, wait_for

pytestmark = pytest.mark.integration

RUN = "r-20240101-120000-abc123"
CHUNK = 64 * 1024
ZSTD = zstandard.ZstdCompressor(level=1)
#: Every checkpoint is a delta of the one before, except each FULL_EVERY-th (a chain's
#: chunks stay needed until a full checkpoint starts the next chain).
FULL_EVERY = 4
GRACE_S = 2.0
RECYCLED = 5
#: Both copies' logs must stay free of these.
TROUBLE = ("checkpoint.gc_failed", "checkpoint.gc_crashed", "checkpoint.damaged",
           "checkpoint.internal_error", "checkpoint.chunk_quarantined")
StartService = Callable[..., ServiceProcess]
State = dict[str, bytes]


def noise(seed: int, size: int) -> bytes:
    """Incompressible bytes, the same for the same seed."""
    return random.Random(seed).randbytes(size)


#: Weights every task starts from (its first checkpoint's chunks are the same in every
#: task: the copies get asked for, and may both write, the very same chunk at once).
FROZEN = noise(1, 4 * CHUNK)


class Copy:
    """One checkpoint-store process and an async client of it."""

    def __init__(self, proc: ServiceProcess, channel: grpc.aio.Channel) -> None:
        self.proc = proc
        self.client = CheckpointClient(channel, timeout_s=30)

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The log lines (JSON) of one event."""
        found = []
        for line in service_log(self.proc).splitlines():
            if f'"{kind}"' in line:
                with contextlib.suppress(ValueError):  # a line being written
                    found.append(json.loads(line))
        return found

    def trouble(self) -> list[str]:
        return [line for line in service_log(self.proc).splitlines()
                if any(f'"{kind}"' in line for kind in TROUBLE)]


class Task:
    """One training task's checkpoints as the test drives them: frozen weights (shared by
    every checkpoint), weights that change a little each time (XOR deltas of the previous
    checkpoint's chunks) and optimizer state (incompressible, new each time unless
    `recycle`)."""

    def __init__(self, index: int, *, attempt: int = 0, scratch_chunks: int = 2,
                 recycle: bool = False) -> None:
        """`recycle`: the optimizer state is one of RECYCLED, by the time: each recurs
        every RECYCLED * GRACE_S / 4 seconds, as its last use's chunks become removable."""
        self.id = f"{RUN}/s{index}"
        self.index = index
        self.attempt = attempt
        self.scratch_chunks = scratch_chunks
        self.recycle = recycle
        self.states: list[State] = []
        self.committed: list[Manifest] = []
        self.expected: dict[str, State] = {}  # checkpoint id → its contents

    def state(self, k: int) -> State:
        moving = bytearray(noise(1000 + self.index, 4 * CHUNK))
        for start in range(0, len(moving), CHUNK):
            moving[start + 64 * (k % 64):start + 64 * (k % 64) + 16] = bytes([k % 251]) * 16
        variant = int(time.time() / (GRACE_S / 4)) % RECYCLED if self.recycle else k
        return {"frozen": FROZEN, "moving": bytes(moving),
                "scratch": noise(10_000 * (self.index + 1) + variant,
                                 self.scratch_chunks * CHUNK)}

    def plan(self) -> tuple[Manifest, dict[str, bytes], State]:
        """The next checkpoint: its manifest, its chunks (id → stored bytes), its state."""
        k = len(self.committed)
        state = self.state(k)
        previous = self.committed[-1] if self.committed else None
        before = self.states[-1] if self.states else None
        entries, chunks = [], {}
        for name, data in state.items():
            old = previous.entry(name) if previous is not None else None
            delta = name == "moving" and before is not None and k % FULL_EVERY != 0

            def previous_raw(i: int, raw: bytes = before[name] if before else b"") -> bytes:
                return raw[i * CHUNK:(i + 1) * CHUNK]

            entry, new = plan_entry(name, "bytes", memoryview(data), old, delta=delta,
                                    compressor=ZSTD, previous_raw=previous_raw,
                                    chunk_bytes=CHUNK)
            entries.append(entry)
            chunks.update(new)
        manifest = Manifest(task_id=self.id, attempt=self.attempt, step=100 * (k + 1),
                            name=f"step-{100 * (k + 1)}", created_at=time.time(),
                            entries=tuple(entries))
        return manifest, chunks, state

    def committed_as(self, manifest: Manifest, state: State) -> Manifest:
        if self.committed:
            assert manifest.checkpoint_id > self.committed[-1].checkpoint_id
            assert manifest.seq == self.committed[-1].seq + 1
        self.committed.append(manifest)
        self.states.append(state)
        self.expected[manifest.checkpoint_id] = state
        return manifest

    async def save(self, copy: Copy) -> Manifest:
        """What the training library does: ask what is missing, send that, commit."""
        manifest, chunks, state = self.plan()
        absent = await copy.client.missing(sorted(chunks), task_id=self.id,
                                           attempt=self.attempt)
        await copy.client.put_chunks(self.id, self.attempt,
                                     {k: v for k, v in chunks.items() if k in absent})
        return self.committed_as(await copy.client.commit(manifest), state)


async def restore(copy: Copy, manifest: Manifest) -> State:
    """Every entry's bytes, read through `copy` (delta bases included), verified."""
    got = {i: d async for i, d in copy.client.read_chunks(sorted(chunk_ids(manifest)))}
    return {e.name: read_entry(e, got.__getitem__) for e in manifest.entries}


def until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """`wait_for` for a thread that is not the event loop's."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def chunk_path(root: Path, chunk_id: str) -> Path:
    return root / "chunks" / chunk_id[:2] / chunk_id


def chunk_files(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").glob("*/*") if not p.name.startswith(".")}


def temp_files(root: Path) -> list[Path]:
    return list((root / "chunks").glob(f"*/{TMP_PREFIX}*"))


def needed(manifests: list[Manifest]) -> set[str]:
    return set().union(*(chunk_ids(m) for m in manifests))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
async def copies(start_service: StartService, root: Path,
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Copy, Copy]]:
    """Copies `a` and `b` on one directory: each keeps a task's last 2 checkpoints and
    collects garbage every 200 ms with a grace period of GRACE_S."""
    monkeypatch.setenv("M27_CHECKPOINT_KEEP_LAST", "2")
    monkeypatch.setenv("M27_CHECKPOINT_GC_INTERVAL", "200ms")
    monkeypatch.setenv("M27_CHECKPOINT_GC_GRACE", f"{GRACE_S}s")
    async with contextlib.AsyncExitStack() as stack:
        started = []
        for name in ("a", "b"):
            proc = start_service("checkpoint_store", "--root", str(root), "--instance", name,
                                 name=f"checkpoint-store-{name}")
            channel = await stack.enter_async_context(
                default_access().channel(proc.grpc_address, options=CHANNEL_OPTIONS))
            started.append(Copy(proc, channel))
        a, b = started
        assert a.proc.grpc_address != b.proc.grpc_address
        yield a, b
        assert a.trouble() == []
        assert b.trouble() == []


@pytest.fixture
async def bus(copies: tuple[Copy, Copy], nats_url: str) -> AsyncIterator[NatsBus]:
    """The test's own view of NATS (the copies made the buckets)."""
    opened = await NatsBus.open(nats_url, name="test-checkpoint-copies")
    try:
        yield opened
    finally:
        await opened.close()


async def test_each_copy_serves_what_the_other_stored(copies: tuple[Copy, Copy],
                                                      bus: NatsBus) -> None:
    """Four tasks upload at once, each checkpoint through the copy its previous one did
    not go through; each is read back byte for byte through the other copy at once and is
    the latest there, ids and seq follow commit order, and both copies list exactly the
    last two of each task. A protection made through one copy holds through commits and
    retention on the other."""
    a, b = copies
    tasks = [Task(i) for i in range(4)]

    async def drive(task: Task, rounds: int) -> None:
        for k in range(rounds):
            via, other = (a, b) if (k + task.index) % 2 == 0 else (b, a)
            committed = await task.save(via)
            assert committed.seq == k + 1
            assert await other.client.latest(task.id) == committed
            assert await restore(other, committed) == task.states[-1]

    await asyncio.gather(*(drive(task, 5) for task in tasks))
    for task in tasks:
        kept = [m.checkpoint_id for m in task.committed[-2:]]
        for copy in (a, b):
            assert await copy.client.latest(task.id) == task.committed[-1]
            assert [s.checkpoint_id for s in await copy.client.list(task.id)] == kept
    index = KvManifestIndex(bus)
    assert sorted(m.checkpoint_id for m in await index.list(ALL_KEYS, strict=True)) == \
        sorted(m.checkpoint_id for t in tasks for m in t.committed[-2:])

    task = tasks[0]
    chosen = task.committed[-2]
    assert chosen.step is not None
    with RemoteStore(a.proc.grpc_address, task_id=task.id, attempt=0, timeout_s=30) as store:
        assert await asyncio.to_thread(store.protect, chosen.step + 1, 0.0,
                                       "loss spike") == chosen.checkpoint_id
    for _ in range(3):
        await task.save(b)
    listed = await a.client.list(task.id)
    assert [(s.checkpoint_id, s.protected) for s in listed] == [
        (chosen.checkpoint_id, "loss spike"),
        *((m.checkpoint_id, "") for m in task.committed[-2:])]
    assert await restore(a, chosen) == task.expected[chosen.checkpoint_id]


async def audit(index: KvManifestIndex, root: Path, stop: asyncio.Event,
                lost: list[str]) -> int:
    """Until `stop`: every chunk of every committed manifest is on disk, unless that
    manifest is retired by the time the check ends (its chunks may go then). Rounds."""
    rounds = 0
    while not stop.is_set():
        for manifest in await index.list(ALL_KEYS, strict=True):
            absent = [c for c in sorted(chunk_ids(manifest))
                      if not chunk_path(root, c).is_file()]
            run_id, step = manifest.task_id.split("/")
            ref = CheckpointRef(run_id, step, manifest.checkpoint_id)
            if absent and await index.get(ref) is not None:
                lost.append(f"{manifest.checkpoint_id} of {manifest.task_id}: {absent[:3]}")
        rounds += 1
        await asyncio.sleep(0.02)
    return rounds


async def test_both_copies_collect_garbage_during_uploads_and_keep_every_live_chunk(
        copies: tuple[Copy, Copy], bus: NatsBus, root: Path) -> None:
    """Both copies collect garbage (every 200 ms, grace 2 s) while uploads go on through
    both, until each has removed chunks of retired checkpoints and each has run rounds
    after the chunks of two idle tasks (committed through both copies at the start) grew
    older than the grace period, so that only the mark keeps them. The busy tasks'
    optimizer state recurs every 2.5 s, just as its chunks become removable, so uploads
    ask for chunks a collection may be removing. Meanwhile no chunk a kept checkpoint
    needs is ever missing; afterwards every kept checkpoint restores through both copies,
    and the directory settles on exactly the kept checkpoints' chunks (delta bases
    included), without temp files."""
    a, b = copies
    index = KvManifestIndex(bus)
    idle = [Task(10), Task(11)]
    for task in idle:
        for copy in (a, b) if task.index % 2 == 0 else (b, a):
            await task.save(copy)
    idle_chunks = needed([m for t in idle for m in t.committed])
    old_at = max(chunk_path(root, c).stat().st_mtime for c in idle_chunks) + GRACE_S
    busy = [Task(i, recycle=True) for i in range(3)]
    stop = asyncio.Event()
    lost: list[str] = []
    auditor = asyncio.create_task(audit(index, root, stop, lost))

    def rounds(copy: Copy) -> list[dict[str, Any]]:
        return copy.events("checkpoint.gc_done")

    async def conduct() -> tuple[int, int]:
        """Until both copies removed chunks and ran 2 rounds each after `old_at`; then
        (or on failure) the uploads stop."""
        try:
            deadline = time.monotonic() + 25
            await wait_for(lambda: time.time() > old_at, "the idle tasks' chunks grow old")
            before = [len(rounds(copy)) for copy in (a, b)]
            while True:
                done = [rounds(copy) for copy in (a, b)]
                removed = [sum(int(e["deleted"]) for e in r) for r in done]
                if all(removed) and all(len(r) >= n + 2
                                        for r, n in zip(done, before, strict=True)):
                    return removed[0], removed[1]
                assert time.monotonic() < deadline, (removed, before, [len(r) for r in done])
                await asyncio.sleep(0.05)
        finally:
            stop.set()

    async def drive(task: Task) -> None:
        while not stop.is_set():
            await task.save(a if (len(task.committed) + task.index) % 2 == 0 else b)

    conductor = asyncio.create_task(conduct())
    try:
        await asyncio.gather(*(drive(task) for task in busy))
        removed = await conductor
    finally:
        conductor.cancel()
        stop.set()
        audits = await auditor
    assert lost == []
    assert audits > 10
    assert all(removed)
    kept = await index.list(ALL_KEYS, strict=True)
    assert sorted(m.checkpoint_id for m in kept) == \
        sorted(m.checkpoint_id for t in idle + busy for m in t.committed[-2:])
    for manifest in kept:
        task = next(t for t in idle + busy if t.id == manifest.task_id)
        for copy in (a, b):
            assert await restore(copy, manifest) == task.expected[manifest.checkpoint_id]
    assert needed(kept) < needed([m for t in busy for m in t.committed]) | idle_chunks
    await wait_for(lambda: chunk_files(root) == needed(kept) and not temp_files(root),
                   "garbage collection settles on the kept checkpoints' chunks",
                   timeout=GRACE_S + 15)


async def test_a_copy_killed_mid_upload_loses_nothing_and_the_other_carries_on(
        copies: tuple[Copy, Copy], root: Path) -> None:
    """SIGKILL `a` while a checkpoint streams into it (some of its chunks already on
    disk): the previous checkpoints are intact and `b` serves them; the client sends the
    same checkpoint again through `b`, which needs only the chunks not on disk; it
    commits, and `b`'s garbage collection leaves only what the kept checkpoints need (no
    temp file of `a`'s either)."""
    a, b = copies
    task = Task(0, scratch_chunks=24)
    await task.save(a)
    await task.save(b)
    manifest, chunks, state = task.plan()
    assert set(chunks) >= {r.id for r in manifest.entries[2].chunks}
    order = list(chunks)

    def requests() -> Iterator[pb.PutChunksRequest]:  # gRPC's sending thread runs it
        yield pb.PutChunksRequest(header=pb.PutChunksHeader(task_id=task.id))
        for position, chunk_id in enumerate(order):
            if position == 6:
                until(lambda: all(chunk_path(root, c).is_file() for c in order[:3]),
                      "a has stored the first chunks")
                os.kill(a.proc.pid, signal.SIGKILL)
                until(lambda: not pid_alive(a.proc.pid), "a is dead")
            yield pb.PutChunksRequest(chunk=pb.Chunk(id=chunk_id, data=chunks[chunk_id]))

    def upload() -> grpc.StatusCode:
        """Through a channel without the client's retries: the failure is seen at once."""
        with default_access().sync_channel(a.proc.grpc_address) as channel:
            try:
                pb_grpc.CheckpointServiceStub(channel).PutChunks(requests(), timeout=30)
            except grpc.RpcError as exc:
                return exc.code()
        raise AssertionError("the upload into the killed copy went through")

    assert await asyncio.to_thread(upload) == grpc.StatusCode.UNAVAILABLE
    # the client sends it again through b: what a stored (and is young, so no collection
    # removed it) is not asked for again, and is kept from now on
    absent = await b.client.missing(sorted(chunks), task_id=task.id)
    assert absent == {c for c in chunks if not chunk_path(root, c).is_file()}
    previous = task.committed
    assert await b.client.latest(task.id) == previous[-1]
    assert [s.checkpoint_id for s in await b.client.list(task.id)] == \
        [m.checkpoint_id for m in previous]
    for committed in previous:
        assert await restore(b, committed) == task.expected[committed.checkpoint_id]
    await b.client.put_chunks(task.id, 0, {k: v for k, v in chunks.items() if k in absent})
    third = task.committed_as(await b.client.commit(manifest), state)
    assert await b.client.latest(task.id) == third
    assert await restore(b, third) == state
    kept = task.committed[-2:]
    await wait_for(lambda: chunk_files(root) == needed(kept) and not temp_files(root),
                   "b's garbage collection removes what only retired checkpoints used",
                   timeout=GRACE_S + 15)


async def test_both_copies_refuse_stale_attempts(copies: tuple[Copy, Copy],
                                                 bus: NatsBus) -> None:
    """Attempt 1 stores chunks through `a`; the task moves on to attempt 2 before it
    commits: neither copy takes anything more from attempt 1 (missing, chunks, commit,
    protect), and attempt 2's checkpoint, committed through `b`, is the only one."""
    a, b = copies

    async def fence(attempt: int) -> None:
        await bus.kv_put(subjects.FENCES_BUCKET, subjects.task_key(stale.id),
                         Fence(task_id=stale.id, attempt=attempt, node_id=f"node-{attempt}",
                               at=time.time()))

    stale = Task(0, attempt=1)
    await fence(1)
    manifest, chunks, _ = stale.plan()
    await a.client.put_chunks(stale.id, 1, chunks)
    await fence(2)
    for copy in (a, b):
        with pytest.raises(StaleAttempt, match=f"attempt 1 of {stale.id} is stale"):
            await copy.client.commit(manifest)
        with pytest.raises(StaleAttempt):
            await copy.client.missing(sorted(chunks), task_id=stale.id, attempt=1)
        # the training library's client (the async one may see a refused stream that it
        # is still writing to as INTERNAL: "Internal error from Core")
        with RemoteStore(copy.proc.grpc_address, task_id=stale.id, attempt=1,
                         timeout_s=30) as store:
            with pytest.raises(StaleAttempt):
                await asyncio.to_thread(store.put_chunks, chunks)
            with pytest.raises(StaleAttempt):
                await asyncio.to_thread(store.protect, 10_000, 0.0, "stale")
    fresh = Task(0, attempt=2)
    committed = await fresh.save(b)
    assert committed.attempt == 2
    for copy in (a, b):
        assert [(s.checkpoint_id, s.attempt) for s in await copy.client.list(fresh.id)] == \
            [(committed.checkpoint_id, 2)]
    assert await restore(a, committed) == fresh.states[-1]


async def test_the_kv_index_protects_and_retires_by_compare_and_set(nats_url: str) -> None:
    """What the copies rely on in NATS KV itself: a retirement never deletes a protected
    manifest, nor one changed since it was read (JetStream refuses the stale revision),
    and a protection never writes a retired manifest back."""
    bus = await NatsBus.open(nats_url, name="test-checkpoint-cas")
    try:
        await ensure_topology(bus.js)
        index = KvManifestIndex(bus)
        kept = Manifest(task_id=f"{RUN}/train", checkpoint_id="c-0000000000001-aaaaaa", seq=1)
        gone = Manifest(task_id=f"{RUN}/train", checkpoint_id="c-0000000000002-bbbbbb", seq=2)
        ref_kept = CheckpointRef(RUN, "train", kept.checkpoint_id)
        ref_gone = CheckpointRef(RUN, "train", gone.checkpoint_id)
        for manifest in (kept, gone):
            await index.put(manifest)
        kv = await bus.kv(subjects.CHECKPOINTS_BUCKET)
        read = (await kv.get(ref_kept.key)).revision
        protected = await index.protect(ref_kept, "loss spike")
        assert protected is not None
        assert protected.protected == "loss spike"
        with pytest.raises(nats.js.errors.APIError) as caught:  # a retirement read `read`
            await kv.delete(ref_kept.key, last=read)
        assert caught.value.err_code in (10071, 10164)
        assert await index.retire(ref_kept) is False
        assert await index.protect(ref_kept, "again") == protected  # the first reason stays
        assert await index.retire(ref_gone) is True
        assert await index.retire(ref_gone) is False
        assert await index.protect(ref_gone, "too late") is None
        assert await index.list(ALL_KEYS, strict=True) == [protected]
    finally:
        await bus.close()
