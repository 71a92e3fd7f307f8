"""checkpoint-store as users run it: the real process, a real nats-server, real gRPC, and
`RemoteStore` as the training library uses it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import msgspec
import numpy as np
import pytest
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from m27.checkpoint_store import KvManifestIndex
from m27.client.checkpoints import (
    CHANNEL_OPTIONS,
    CheckpointClient,
    RemoteStore,
    next_wait,
)
from m27.common import events, subjects
from m27.common.api_auth import default_access
from m27.common.bus import NatsBus
from m27.common.checkpoint_api import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointTooLarge,
    ChunksMissing,
    InvalidCheckpointRequest,
    StaleAttempt,
    StorageUnavailable,
)
from m27.common.checkpoint_format import Manifest, chunk_ids, plan_entry, read_entry
from m27.common.model import Fence
from m27.embedded.processes import ServiceProcess, stop
from m27.node_agent._checkpoint_files import upload
from m27.node_agent._file_sync import remote_stores, restore_files
from m27.node_agent._tasks import CannotStart
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
CHUNK = 256 * 1024
ZSTD = zstandard.ZstdCompressor(level=3)
Code = grpc.StatusCode
StartService = Callable[..., ServiceProcess]


def tensors(seed: int = 0, n: int = 400_000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"encoder.weight": rng.standard_normal(n).astype(np.float32),
            "decoder.weight": rng.standard_normal(n // 2).astype(np.float32),
            "step": np.array([seed], dtype=np.int64)}


def plan(state: dict[str, np.ndarray], previous: Manifest | None = None, *,
         task_id: str = TASK, attempt: int = 0,
         step: int | None = None) -> tuple[Manifest, dict[str, bytes]]:
    """A checkpoint of `state` the way the training library builds one."""
    entries, chunks = [], {}
    for name, array in state.items():
        before = previous.entry(name) if previous else None
        entry, new = plan_entry(name, "tensor", memoryview(array.tobytes()), before,
                                delta=False, compressor=ZSTD, chunk_bytes=CHUNK,
                                dtype=str(array.dtype), shape=array.shape)
        entries.append(entry)
        chunks.update(new)
    return Manifest(task_id=task_id, attempt=attempt, step=step, name=f"step-{step}",
                    entries=tuple(entries)), chunks


def save(store: RemoteStore, manifest: Manifest, chunks: dict[str, bytes]) -> Manifest:
    absent = store.missing(sorted(chunks))
    store.put_chunks({k: v for k, v in chunks.items() if k in absent})
    return store.commit(manifest)


def restore(store: RemoteStore, manifest: Manifest) -> dict[str, bytes]:
    fetched = store.fetch(manifest.entries)
    return {e.name: read_entry(e, fetched.__getitem__) for e in manifest.entries}


def raw(state: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in state.items()}


def chunk_path(root: Path, chunk_id: str) -> Path:
    return root / "chunks" / chunk_id[:2] / chunk_id


def chunk_files(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").glob("*/*") if not p.name.startswith(".")}


@contextlib.contextmanager
def remote(proc: ServiceProcess, attempt: int = 0) -> Iterator[RemoteStore]:
    store = RemoteStore(proc.grpc_address, task_id=TASK, attempt=attempt, timeout_s=60)
    try:
        yield store
    finally:
        store.close()


@contextlib.asynccontextmanager
async def stub_of(proc: ServiceProcess) -> AsyncIterator[pb_grpc.CheckpointServiceAsyncStub]:
    async with default_access().channel(proc.grpc_address, options=CHANNEL_OPTIONS) as ch:
        yield pb_grpc.CheckpointServiceStub(ch)


def test_an_unchanged_majority_is_not_sent_again_and_restores_exactly(
        start_service: StartService, tmp_path: Path) -> None:
    """Two checkpoints through RemoteStore: the second, with one tensor changed, sends
    only that tensor's chunks (seen in `missing` and in `new_bytes`); both restore to the
    original bytes."""
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    first_state = tensors(0)
    with remote(proc) as store:
        first_manifest, first_chunks = plan(first_state, step=100)
        assert store.missing(sorted(first_chunks)) == set(first_chunks)
        first = save(store, first_manifest, first_chunks)
        assert first.new_bytes == sum(len(v) for v in first_chunks.values())
        second_state = dict(first_state, step=np.array([1], dtype=np.int64))
        second_state["decoder.weight"] = second_state["decoder.weight"] * np.float32(0.99)
        manifest, chunks = plan(second_state, first, step=200)
        changed = {r.id for e in manifest.entries if e.name != "encoder.weight"
                   for r in e.chunks}
        assert store.missing(sorted(changed | chunk_ids(first))) == changed
        second = save(store, manifest, chunks)
        assert second.new_bytes == sum(len(chunks[c]) for c in changed)
        assert second.new_bytes < 0.4 * first.new_bytes
        assert second.step == 200
        assert store.latest(TASK) == second
        assert [m.checkpoint_id for m in store.list(TASK)] == \
            [first.checkpoint_id, second.checkpoint_id]
        assert restore(store, store.latest(TASK)) == raw(second_state)  # type: ignore[arg-type]
        assert restore(store, store.get_manifest(TASK, first.checkpoint_id)) == raw(first_state)
        summaries = store.summaries(run_id=RUN)
    assert [(s.step, s.seq, s.full, s.entries) for s in summaries] == \
        [(100, 1, True, 3), (200, 2, True, 3)]
    assert chunk_files(root) == chunk_ids(first) | chunk_ids(second)


def test_nothing_is_visible_before_commit_and_missing_chunks_refuse_it(
        start_service: StartService, tmp_path: Path) -> None:
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    with remote(proc) as store:
        manifest, chunks = plan(tensors(1))
        half = dict(list(chunks.items())[: len(chunks) // 2])
        store.put_chunks(half)
        assert store.latest(TASK) is None
        with pytest.raises(ChunksMissing, match="are not stored"):
            store.commit(manifest)
        assert store.list(TASK) == []
        store.put_chunks(chunks)
        assert store.commit(manifest).seq == 1


async def test_a_flipped_byte_is_data_loss_and_latest_falls_back_with_an_event(
        start_service: StartService, tmp_path: Path, nats_url: str) -> None:
    """Reading the damaged chunk ends GetChunks with DATA_LOSS naming it; the next
    `latest` hands out the previous checkpoint and publishes `checkpoint_corrupt`."""
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    bus = await NatsBus.open(nats_url, name="test-checkpoint-events")
    seen: list[events.Event] = []

    async def on_event(msg: object) -> None:
        seen.append(events.decode_event(msg.data))  # type: ignore[attr-defined]

    await bus.nc.subscribe(subjects.task_events_of(RUN, "train"), cb=on_event)
    try:
        with remote(proc) as store:
            good = await asyncio.to_thread(save, store, *plan(tensors(2)))
            bad_manifest, bad_chunks = plan(tensors(3), good)
            bad = await asyncio.to_thread(save, store, bad_manifest, bad_chunks)
            victim = bad.entries[0].chunks[1].id
            path = chunk_path(root, victim)
            damaged = bytearray(path.read_bytes())
            damaged[len(damaged) // 2] ^= 0xFF
            path.write_bytes(bytes(damaged))
            async with stub_of(proc) as stub:
                got: list[str] = []

                async def read() -> None:
                    async for chunk in stub.GetChunks(pb.GetChunksRequest(
                            ids=[r.id for r in bad.entries[0].chunks]), timeout=30):
                        got.append(chunk.id)

                assert victim in await expect(Code.DATA_LOSS, read)
            assert got == [bad.entries[0].chunks[0].id]
            with pytest.raises(CheckpointCorrupt, match=victim):
                await asyncio.to_thread(restore, store, bad)
            latest = await asyncio.to_thread(store.latest, TASK)
            assert latest is not None
            assert latest.checkpoint_id == good.checkpoint_id
            assert await asyncio.to_thread(restore, store, latest) == raw(tensors(2))
        deadline = time.monotonic() + 10
        while not any(isinstance(e, events.CheckpointCorrupt) for e in seen):
            assert time.monotonic() < deadline, "no checkpoint_corrupt event"
            await asyncio.sleep(0.05)
    finally:
        await bus.close()
    # each commit was announced (the scheduler's "last checkpoint"), then the damage
    assert [(e.checkpoint_id, e.attempt) for e in seen
            if isinstance(e, events.CheckpointCommitted)] == [
        (good.checkpoint_id, good.attempt), (bad.checkpoint_id, bad.attempt)]
    (event,) = [e for e in seen if isinstance(e, events.CheckpointCorrupt)]
    assert (event.task_id, event.checkpoint_id, event.chunk_id, event.fell_back_to) == \
        (TASK, bad.checkpoint_id, victim, good.checkpoint_id)


def test_retention_and_gc_remove_old_manifests_then_only_their_chunks(
        start_service: StartService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_last=2, keep_every=3: after five checkpoints seq 3, 4, 5 remain; GC (grace 1s)
    then removes the chunks only seq 1 and 2 used, and nothing a kept checkpoint needs."""
    monkeypatch.setenv("M27_CHECKPOINT_KEEP_LAST", "2")
    monkeypatch.setenv("M27_CHECKPOINT_KEEP_EVERY", "3")
    monkeypatch.setenv("M27_CHECKPOINT_GC_INTERVAL", "300ms")
    monkeypatch.setenv("M27_CHECKPOINT_GC_GRACE", "1s")
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    with remote(proc) as store:
        committed: list[Manifest] = []
        state = tensors(4, n=100_000)
        for i in range(5):
            state = dict(state, step=np.array([i], dtype=np.int64))
            committed.append(save(store, *plan(state, committed[-1] if committed else None,
                                               step=i)))
        assert [s.seq for s in store.summaries(TASK)] == [3, 4, 5]
        needed = set().union(*(chunk_ids(m) for m in committed[2:]))
        retired_only = set().union(*(chunk_ids(m) for m in committed[:2])) - needed
        assert len(retired_only) == 2  # the two old `step` tensors
        deadline = time.monotonic() + 20
        while chunk_files(root) != needed:
            assert time.monotonic() < deadline, chunk_files(root) - needed
            time.sleep(0.1)
        assert restore(store, committed[2]) == restore(store, store.get_manifest(
            TASK, committed[2].checkpoint_id))


async def test_stale_attempts_are_refused(start_service: StartService, tmp_path: Path,
                                          nats_url: str) -> None:
    """With the task's fence at attempt 2, attempt 1 can neither upload nor commit."""
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    bus = await NatsBus.open(nats_url, name="test-fence")
    try:
        await bus.kv_put(subjects.FENCES_BUCKET, subjects.task_key(TASK),
                         Fence(task_id=TASK, attempt=2, node_id="node-b", at=time.time()))
    finally:
        await bus.close()
    manifest, chunks = plan(tensors(5, n=1000), attempt=1)
    with remote(proc, attempt=1) as stale:
        with pytest.raises(StaleAttempt, match=f"attempt 1 of {TASK} is stale"):
            await asyncio.to_thread(stale.missing, sorted(chunks))
        with pytest.raises(StaleAttempt):
            await asyncio.to_thread(stale.put_chunks, chunks)
        with pytest.raises(StaleAttempt):
            await asyncio.to_thread(stale.commit, manifest)
        with pytest.raises(StaleAttempt):
            await asyncio.to_thread(stale.put_bytes, TASK, b"late", attempt=1)
    assert chunk_files(root) == set()
    with remote(proc, attempt=2) as fresh:
        ok = await asyncio.to_thread(save, fresh, *plan(tensors(5, n=1000), attempt=2))
        assert ok.attempt == 2
        assert [m.attempt for m in await asyncio.to_thread(fresh.list, TASK)] == [2]


HOSTILE_TASK_IDS = ["../../etc", "r-x/../y", "/etc/passwd", f"{RUN}//etc/passwd",
                    f"{RUN}/../../../tmp", f"{RUN}/train\n", ""]
HOSTILE_CHECKPOINT_IDS = ["../../../../etc/passwd", "/etc/passwd", "c-1/../../x", "*", ">"]
HOSTILE_NAMES = ["../../outside", "/etc/passwd", "a/../../b", "a\x00b"]


async def finish(call: Callable[[], object]) -> None:
    """Await an RPC, or drain a streaming one, or await a coroutine consuming one."""
    result = call()
    if hasattr(result, "__aiter__"):
        async for _ in result:
            pass
    else:
        await result  # type: ignore[misc]


async def expect(code: Code, call: Callable[[], object]) -> str:
    """The details of the status `call` must fail with."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await finish(call)
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details() or ""


async def test_hostile_ids_and_names_are_invalid_and_touch_nothing(
        start_service: StartService, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    before = sorted(p.name for p in tmp_path.iterdir())
    layout = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    good_id = "c-0000000000001-000000"
    async with stub_of(proc) as stub:
        for task_id in HOSTILE_TASK_IDS:
            calls: list[Callable[[], object]] = [
                partial(stub.GetManifest, pb.GetManifestRequest(task_id=task_id)),
                partial(stub.List, pb.ListRequest(task_id=task_id)),
                partial(stub.Delete, pb.DeleteRequest(task_id=task_id, checkpoint_id=good_id)),
                partial(stub.Commit, pb.CommitRequest(task_id=task_id, manifest_json="{}")),
                partial(stub.PutChunks, iter([pb.PutChunksRequest(
                    header=pb.PutChunksHeader(task_id=task_id))])),
            ]
            if task_id:  # an empty task makes MissingChunks unfenced, which is allowed
                calls.append(partial(stub.MissingChunks,
                                     pb.MissingChunksRequest(task_id=task_id, ids=["0" * 64])))
            for call in calls:
                details = await expect(Code.INVALID_ARGUMENT, call)
                assert "task_id must be" in details or "exactly one of task_id" in details
        for checkpoint_id in HOSTILE_CHECKPOINT_IDS:
            by_checkpoint: list[Callable[[], object]] = [
                partial(stub.GetManifest, pb.GetManifestRequest(
                    task_id=TASK, checkpoint_id=checkpoint_id)),
                partial(stub.Delete, pb.DeleteRequest(task_id=TASK, checkpoint_id=checkpoint_id))]
            for call in by_checkpoint:
                assert "checkpoint_id must look like" in \
                    await expect(Code.INVALID_ARGUMENT, call)
        for chunk_id in ["../../../etc/passwd", "0" * 63, "*"]:
            by_chunk: list[Callable[[], object]] = [
                partial(stub.GetChunks, pb.GetChunksRequest(ids=[chunk_id])),
                partial(stub.MissingChunks, pb.MissingChunksRequest(ids=[chunk_id]))]
            for call in by_chunk:
                assert "64 lower-case hex" in await expect(Code.INVALID_ARGUMENT, call)
        for name in HOSTILE_NAMES:
            entry, _ = plan_entry(name, "file", memoryview(b"x"), None, delta=False,
                                  compressor=ZSTD)
            manifest = Manifest(task_id=TASK, entries=(entry,))
            text = msgspec.json.encode(manifest).decode()
            assert "entry name" in await expect(Code.INVALID_ARGUMENT, partial(
                stub.Commit, pb.CommitRequest(task_id=TASK, manifest_json=text)))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == layout


def test_checkpoints_survive_a_restart(start_service: StartService, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    first = start_service("checkpoint_store", "--root", root)
    with remote(first) as store:
        committed = save(store, *plan(tensors(6)))
    stop([first])
    second = start_service("checkpoint_store", "--root", root, name="checkpoint_store-2")
    with remote(second) as store:
        assert store.latest(TASK) == committed
        assert restore(store, committed) == raw(tensors(6))


def test_a_patient_client_waits_out_a_store_restarting(start_service: StartService,
                                                      tmp_path: Path) -> None:
    """Found by the chaos suite: the checkpoint-store killed as a step saved its last
    checkpoint failed the step. The training library's client (`outage_s`) tries again
    until the store is back on its address; one without patience says so at once."""
    root = str(tmp_path / "ckpt")
    first = start_service("checkpoint_store", "--root", root)
    address = first.grpc_address
    os.kill(first.pid, signal.SIGKILL)
    stop([first])
    impatient = RemoteStore(address, task_id=TASK, timeout_s=10)
    patient = RemoteStore(address, task_id=TASK, timeout_s=10, outage_s=60)
    try:
        with pytest.raises(StorageUnavailable):
            impatient.put_bytes(TASK, b"state")
        saved: list[Manifest] = []
        writer = threading.Thread(target=lambda: saved.append(patient.put_bytes(
            TASK, b"state", name="last")))
        writer.start()  # while nothing listens on the address
        start_service("checkpoint_store", "--root", root, "--grpc", address,
                      name="checkpoint_store-2")
        writer.join(60)
        assert [m.name for m in saved] == ["last"]
        assert patient.get_bytes(TASK)[1] == b"state"
    finally:
        impatient.close()
        patient.close()


async def test_an_agent_restoring_a_steps_files_waits_out_a_store_restarting(
        start_service: StartService, tmp_path: Path) -> None:
    """Found by the chaos suite (seed 1005): the checkpoint-store killed as a step that
    keeps its own checkpoint files moved to another node failed the step ("could not
    restore the step's checkpoint files: … Connection refused"). The agent's restore
    now tries again until the store is back; past its limit it says so."""
    root = str(tmp_path / "ckpt")
    first = start_service("checkpoint_store", "--root", root)
    address = first.grpc_address
    source = tmp_path / "node-a"
    source.mkdir()
    (source / "state.cpt").write_bytes(os.urandom(100_000))
    with remote(first, attempt=1) as store:
        assert upload(store, TASK, 1, source, level=3, max_bytes=1 << 30, now=1.0)
    os.kill(first.pid, signal.SIGKILL)
    stop([first])
    opener = remote_stores(default_access())
    with pytest.raises(CannotStart, match="unreachable for 1s"):
        await restore_files(opener, address, TASK, 2, tmp_path / "never", outage_s=1.0)
    target = tmp_path / "node-b"
    restoring = asyncio.ensure_future(restore_files(opener, address, TASK, 2, target))
    await asyncio.sleep(0)  # it starts while nothing listens on the address
    await asyncio.to_thread(start_service, "checkpoint_store", "--root", root, "--grpc",
                            address, name="checkpoint_store-2")
    restored = await asyncio.wait_for(restoring, 60)
    assert restored is not None
    assert restored.attempt == 1
    assert (target / "state.cpt").read_bytes() == (source / "state.cpt").read_bytes()


def test_the_wait_through_an_outage_ends_at_its_limit() -> None:
    assert next_wait(began=0.0, now=0.0, wait=0.5, outage_s=60.0) == 0.5
    assert next_wait(began=0.0, now=59.0, wait=1.0, outage_s=60.0) == 1.0
    assert next_wait(began=0.0, now=59.5, wait=1.0, outage_s=60.0) is None
    assert next_wait(began=0.0, now=0.0, wait=0.5, outage_s=0.0) is None  # no patience


def test_a_crash_mid_upload_keeps_the_previous_checkpoint(start_service: StartService,
                                                          tmp_path: Path) -> None:
    """SIGKILL while chunks stream in: after a restart the previous checkpoint is the
    latest and restores; the interrupted chunks are at most unreferenced files."""
    root = tmp_path / "ckpt"
    first = start_service("checkpoint_store", "--root", str(root))
    with remote(first) as store:
        previous = save(store, *plan(tensors(7)))
        _, chunks = plan(tensors(8, n=2_000_000))

        def trickle() -> Iterator[pb.PutChunksRequest]:
            yield pb.PutChunksRequest(header=pb.PutChunksHeader(task_id=TASK))
            for index, (chunk_id, data) in enumerate(chunks.items()):
                if index == 3:
                    os.kill(first.pid, signal.SIGKILL)
                    time.sleep(0.5)
                yield pb.PutChunksRequest(chunk=pb.Chunk(id=chunk_id, data=data))

        with default_access().sync_channel(first.grpc_address) as channel, \
                pytest.raises(grpc.RpcError) as caught:
            pb_grpc.CheckpointServiceStub(channel).PutChunks(trickle(), timeout=30)
        assert caught.value.code() == Code.UNAVAILABLE
    second = start_service("checkpoint_store", "--root", str(root), name="checkpoint_store-2")
    with remote(second) as store:
        assert [m.checkpoint_id for m in store.list(TASK)] == [previous.checkpoint_id]
        assert restore(store, store.latest(TASK)) == raw(tensors(7))  # type: ignore[arg-type]


def test_blobs_through_put_bytes_and_the_size_limit(start_service: StartService,
                                                    tmp_path: Path) -> None:
    """The opaque-blob convenience (what the failover test and file uploads use) and
    `--max-size`: a larger upload is RESOURCE_EXHAUSTED."""
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"),
                         "--max-size", "2MiB")
    data = os.urandom(2 * 1024 * 1024)
    with remote(proc) as store:
        stored = store.put_bytes(TASK, data, name="full", metadata={"epoch": "7"})
        assert (stored.size_bytes, stored.metadata, stored.name) == \
            (len(data), {"epoch": "7"}, "full")
        again = store.put_bytes(TASK, data, name="same")
        assert again.new_bytes == 0  # the same bytes: nothing was sent or stored again
        manifest, payload = store.get_bytes(TASK, stored.checkpoint_id)
        assert (manifest, payload) == (stored, data)
        with pytest.raises(CheckpointTooLarge, match="at most 2097152 bytes"):
            store.put_bytes(TASK, data + b"!")
        assert store.delete(TASK, stored.checkpoint_id) is True
        assert [m.checkpoint_id for m in store.list(TASK)] == [again.checkpoint_id]
        with pytest.raises(CheckpointNotFound):
            store.get_manifest(TASK, stored.checkpoint_id)
        with pytest.raises(InvalidCheckpointRequest):
            store.summaries(TASK, RUN)


async def test_the_async_client(start_service: StartService, tmp_path: Path) -> None:
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    async with default_access().channel(proc.grpc_address, options=CHANNEL_OPTIONS) as ch:
        client = CheckpointClient(ch, timeout_s=30)
        stored = await client.put_bytes(TASK, b"state" * 1000, attempt=0, name="x")
        got, data = await client.get_bytes(TASK)
        assert (got, data) == (stored, b"state" * 1000)
        assert [s.checkpoint_id for s in await client.list(run_id=RUN)] == [stored.checkpoint_id]


async def test_reflection_lists_the_service_and_health_is_serving(
        start_service: StartService, tmp_path: Path) -> None:
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    async with default_access().channel(proc.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="m27.v1.CheckpointService"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert "m27.v1.CheckpointService" in names


async def test_the_kv_index_lists_one_task_among_many(nats_url: str) -> None:
    """Listing filters on the server: other tasks and deleted manifests never show up, and
    more manifests than a watcher's queue holds (256) all arrive."""
    bus = await NatsBus.open(nats_url, name="test-checkpoint-index")
    try:
        index = KvManifestIndex(bus)

        def manifest(step: str, n: int) -> Manifest:
            return Manifest(task_id=f"{RUN}/{step}", checkpoint_id=f"c-{n:013d}-abcdef",
                                  seq=n)

        await asyncio.gather(*(index.put(manifest("train", n)) for n in range(1, 301)))
        await asyncio.gather(*(index.put(manifest(step, 1)) for step in ("eval", "train2")))
        from m27.checkpoint_store._ids import CheckpointRef
        from m27.checkpoint_store._index import ALL_KEYS, task_pattern

        await index.delete(CheckpointRef(RUN, "train", "c-0000000000007-abcdef"))
        listed = await index.list(task_pattern(RUN, "train"))
        assert sorted(m.seq for m in listed) == [n for n in range(1, 301) if n != 7]
        assert await index.list(task_pattern(RUN, "missing")) == []
        assert len(await index.list(ALL_KEYS, strict=True)) == 301
        assert await index.get(CheckpointRef(RUN, "eval", "c-0000000000001-abcdef")) == \
            manifest("eval", 1)
    finally:
        await bus.close()
