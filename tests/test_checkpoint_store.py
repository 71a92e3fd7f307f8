"""checkpoint-store as users run it: the real process, a real nats-server, real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from m27.checkpoint_store import (
    CheckpointClient,
    CheckpointRecord,
    CheckpointRef,
    CheckpointTooLarge,
    KvRecordIndex,
)
from m27.common.bus import Bus
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.embedded.processes import ServiceProcess, stop
from m27.v1 import checkpoint_pb2 as pb
from m27.v1 import checkpoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from m27.v1.checkpoint_pb2_grpc import CheckpointServiceAsyncStub as Stub

pytestmark = pytest.mark.integration

RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
MiB = 1024 * 1024
Code = grpc.StatusCode


@contextlib.asynccontextmanager
async def connect(proc: ServiceProcess) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(proc.grpc_address, options=CLIENT_OPTIONS) as channel:
        yield pb_grpc.CheckpointServiceStub(channel)


async def put(stub: Stub, data: bytes, *, task_id: str = TASK, part: int = 256 * 1024,
              name: str = "", attempt: int = 0) -> pb.CheckpointInfo:
    async def requests() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.CheckpointHeader(task_id=task_id, attempt=attempt,
                                                       name=name))
        for start in range(0, len(data), part):
            yield pb.PutRequest(data=data[start:start + part])

    return await stub.Put(requests(), timeout=30)


async def get(stub: Stub, task_id: str = TASK,
              checkpoint_id: str = "") -> tuple[pb.CheckpointInfo, list[bytes]]:
    replies = [r async for r in stub.Get(pb.GetRequest(task_id=task_id,
                                                       checkpoint_id=checkpoint_id),
                                         timeout=30)]
    assert replies
    assert replies[0].WhichOneof("part") == "info"
    assert all(r.WhichOneof("part") == "data" for r in replies[1:])
    return replies[0].info, [r.data for r in replies[1:]]


async def listed(stub: Stub, task_id: str = TASK) -> list[str]:
    reply = await stub.List(pb.ListRequest(task_id=task_id), timeout=10)
    return [info.checkpoint_id for info in reply.checkpoints]


async def expect_status(code: Code, call: Callable[[], Awaitable[object]]) -> str:
    """Await `call` (an RPC, or a coroutine consuming one); return the status details."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call()
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details() or ""


def blob_path(root: Path, info: pb.CheckpointInfo) -> Path:
    run_id, step = info.task_id.split("/")
    return root / run_id / step / f"{info.checkpoint_id}.blob"


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


async def test_put_in_chunks_then_get_returns_identical_bytes(start_service: Callable[...,
                                                              ServiceProcess],
                                                              tmp_path: Path) -> None:
    """A multi-MiB blob sent in 256 KiB parts comes back byte for byte, in ≤1 MiB chunks."""
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    data = os.urandom(5 * MiB + 12345)
    async with connect(proc) as stub:
        info = await put(stub, data, name="epoch-3", attempt=2)
        assert info.size_bytes == len(data)
        assert info.sha256 == hashlib.sha256(data).hexdigest()
        assert (info.task_id, info.name, info.attempt) == (TASK, "epoch-3", 2)
        got, chunks = await get(stub, TASK, info.checkpoint_id)
    assert got == info
    assert b"".join(chunks) == data
    assert max(map(len, chunks)) == MiB
    assert blob_path(tmp_path / "ckpt", info).read_bytes() == data


async def test_list_is_oldest_first_latest_by_empty_id_and_delete(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    """List orders by commit; an empty id gets the newest; Delete removes record and file."""
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    async with connect(proc) as stub:
        infos = [await put(stub, f"state {i}".encode()) for i in range(3)]
        await put(stub, b"another task", task_id=f"{RUN}/eval")
        ids = [i.checkpoint_id for i in infos]
        assert await listed(stub) == ids
        latest, chunks = await get(stub)
        assert latest.checkpoint_id == ids[-1]
        assert chunks == [b"state 2"]
        reply = await stub.Delete(pb.DeleteRequest(task_id=TASK, checkpoint_id=ids[-1]))
        assert reply.deleted is True
        assert not blob_path(tmp_path / "ckpt", infos[-1]).exists()
        assert await listed(stub) == ids[:-1]
        assert (await get(stub))[0].checkpoint_id == ids[1]
        await expect_status(Code.NOT_FOUND, lambda: get(stub, TASK, ids[-1]))
        again = await stub.Delete(pb.DeleteRequest(task_id=TASK, checkpoint_id=ids[-1]))
        assert again.deleted is False


async def test_unknown_tasks_and_checkpoints_are_not_found(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    async with connect(proc) as stub:
        assert "has no checkpoints" in await expect_status(Code.NOT_FOUND, lambda: get(stub))
        await put(stub, b"x")
        details = await expect_status(Code.NOT_FOUND,
                                      lambda: get(stub, TASK, "c-0000000000001-000000"))
        assert "c-0000000000001-000000" in details
        assert await listed(stub, f"{RUN}/never") == []


HOSTILE_TASK_IDS = ["../../etc", "r-x/../y", "/etc/passwd", f"{RUN}//etc/passwd",
                    f"{RUN}/../../../tmp", f"{RUN}/train\n", ""]
HOSTILE_CHECKPOINT_IDS = ["../../../../etc/passwd", "/etc/passwd", "c-1/../../x", "*", ">"]


async def test_hostile_ids_are_invalid_arguments_and_touch_nothing(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    """Path-like task and checkpoint ids are refused by every RPC before any file access."""
    root = tmp_path / "ckpt"
    proc = start_service("checkpoint_store", "--root", str(root))
    before = sorted(p.name for p in tmp_path.iterdir())
    async with connect(proc) as stub:
        for task_id in HOSTILE_TASK_IDS:
            for call in (lambda t=task_id: put(stub, b"evil", task_id=t),
                         lambda t=task_id: get(stub, t),
                         lambda t=task_id: stub.List(pb.ListRequest(task_id=t)),
                         lambda t=task_id: stub.Delete(pb.DeleteRequest(
                             task_id=t, checkpoint_id="c-0000000000001-000000"))):
                assert "task_id must be" in await expect_status(Code.INVALID_ARGUMENT, call)
        for checkpoint_id in HOSTILE_CHECKPOINT_IDS:
            for call in (lambda c=checkpoint_id: get(stub, TASK, c),
                         lambda c=checkpoint_id: stub.Delete(pb.DeleteRequest(
                             task_id=TASK, checkpoint_id=c))):
                details = await expect_status(Code.INVALID_ARGUMENT, call)
                assert "checkpoint_id must look like" in details
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in root.iterdir()) == [".tmp"]


async def test_a_flipped_byte_on_disk_makes_get_fail_with_data_loss(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    """Corrupt stored bytes are never handed over as a whole: the stream ends in DATA_LOSS."""
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    data = os.urandom(3 * MiB)
    async with connect(proc) as stub:
        info = await put(stub, data)
        path = blob_path(tmp_path / "ckpt", info)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
        received = bytearray()

        async def read() -> None:
            async for reply in stub.Get(pb.GetRequest(task_id=TASK), timeout=30):
                received.extend(reply.data)

        assert "corrupt" in await expect_status(Code.DATA_LOSS, read)
    assert len(received) < len(data)


async def test_records_survive_a_restart(start_service: Callable[..., ServiceProcess],
                                         tmp_path: Path) -> None:
    """After the service stops and starts again, its checkpoints are still listed and read."""
    root = str(tmp_path / "ckpt")
    first = start_service("checkpoint_store", "--root", root)
    async with connect(first) as stub:
        info = await put(stub, b"durable state" * 1000)
    stop([first])
    second = start_service("checkpoint_store", "--root", root, name="checkpoint_store-2")
    async with connect(second) as stub:
        assert await listed(stub) == [info.checkpoint_id]
        got, chunks = await get(stub)
    assert got == info
    assert b"".join(chunks) == b"durable state" * 1000


async def test_a_crash_mid_put_keeps_the_previous_checkpoint(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    """SIGKILL during a Put: after restart the old checkpoint is the latest, no temp is left."""
    root = tmp_path / "ckpt"
    first = start_service("checkpoint_store", "--root", str(root))
    hold = asyncio.Event()

    async def never_ending() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.CheckpointHeader(task_id=TASK))
        for _ in range(3):
            yield pb.PutRequest(data=os.urandom(MiB))
        await hold.wait()

    async with connect(first) as stub:
        previous = await put(stub, b"previous")
        call = asyncio.ensure_future(stub.Put(never_ending()))
        await asyncio.to_thread(wait_until, lambda: any(
            p.stat().st_size > 0 for p in (root / ".tmp").iterdir()))
        os.kill(first.pid, signal.SIGKILL)
        await expect_status(Code.UNAVAILABLE, lambda: call)
        hold.set()
    second = start_service("checkpoint_store", "--root", str(root), name="checkpoint_store-2")
    assert list((root / ".tmp").iterdir()) == []
    async with connect(second) as stub:
        assert await listed(stub) == [previous.checkpoint_id]
        assert (await get(stub))[1] == [b"previous"]


async def test_reflection_lists_the_service_and_health_is_serving(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))
    async with grpc.aio.insecure_channel(proc.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="m27.v1.CheckpointService"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert "m27.v1.CheckpointService" in names


async def test_the_client_helper_and_the_size_limit(
        start_service: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    """`CheckpointClient` round-trips bytes; past `--max-size` a Put is RESOURCE_EXHAUSTED."""
    proc = start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"),
                         "--max-size", "2MiB")
    data = os.urandom(2 * MiB)
    async with grpc.aio.insecure_channel(proc.grpc_address, options=CLIENT_OPTIONS) as channel:
        client = CheckpointClient(channel, timeout_s=30)
        record = await client.put(TASK, data, name="full", metadata={"epoch": "7"})
        assert (record.size_bytes, record.metadata) == (len(data), {"epoch": "7"})
        got, payload = await client.get(TASK)
        assert got == record
        assert payload == data
        assert [r.checkpoint_id for r in await client.list(TASK)] == [record.checkpoint_id]
        with pytest.raises(CheckpointTooLarge, match="at most 2097152 bytes"):
            await client.put(TASK, data + b"!")
        assert await client.delete(TASK, record.checkpoint_id) is True
        assert await client.list(TASK) == []


async def test_the_kv_index_lists_one_task_among_many(nats_url: str) -> None:
    """Listing filters on the server: other tasks and deleted records never show up, and
    more records than the watcher's queue holds (256) all arrive."""
    bus = await Bus.open(nats_url, name="test-checkpoint-index")
    try:
        index = KvRecordIndex(bus)

        def record(step: str, n: int) -> CheckpointRecord:
            return CheckpointRecord(task_id=f"{RUN}/{step}",
                                    checkpoint_id=f"c-{n:013d}-abcdef", attempt=0, name="",
                                    size_bytes=n, sha256="0" * 64, created_at=n / 1000)

        await asyncio.gather(*(index.put(record("train", n)) for n in range(1, 301)))
        await asyncio.gather(*(index.put(record(step, 1)) for step in ("eval", "train2")))
        await index.delete(CheckpointRef(RUN, "train", "c-0000000000007-abcdef"))
        listed_records = await index.list(RUN, "train")
        assert sorted(r.size_bytes for r in listed_records) == [
            n for n in range(1, 301) if n != 7]
        assert await index.list(RUN, "missing") == []
        assert await index.get(CheckpointRef(RUN, "train", "c-0000000000007-abcdef")) is None
        assert await index.get(record("eval", 1).ref) == record("eval", 1)
    finally:
        await bus.close()
