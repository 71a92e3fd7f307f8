"""`NodeService.TailLog` over a real gRPC server: whole logs, tails, follow, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.events import StartTask
from m27.common.grpc_server import start_server
from m27.common.logfiles import log_path
from m27.common.model import TaskHolding
from m27.node_agent._tasks import task_paths
from m27.node_agent.api import SERVICE_NAME, NodeServicer, running_check, tail_query
from m27.v1 import cluster_pb2 as pb
from m27.v1 import cluster_pb2_grpc as pb_grpc

KEYS = ephemeral_keys()
ORCHESTRATOR = ApiAccess(token=KEYS.mint(user="orchestrator", role="node", ttl_s=0))


RUN = "r-20250101-120000-abcdef"
TASK = f"{RUN}/train"


class Running:
    """What the runner would say: which (task, attempt) runs now."""

    def __init__(self) -> None:
        self.now: set[tuple[str, int]] = set()

    def __call__(self, task_id: str, attempt: int) -> bool:
        return (task_id, attempt) in self.now


@pytest.fixture
def running() -> Running:
    return Running()


@pytest.fixture
async def stub(tmp_path: Path, running: Running) -> AsyncIterator[pb_grpc.NodeServiceAsyncStub]:
    servicer = NodeServicer(tmp_path, "node-7", running, poll_s=0.02)
    server = await start_server("127.0.0.1:0", [servicer.register], [SERVICE_NAME], keys=KEYS)
    async with ORCHESTRATOR.channel(server.address) as channel:
        yield pb_grpc.NodeServiceStub(channel)
    await server.stop(0)


def write(home: Path, stream: str, data: bytes, attempt: int = 1) -> Path:
    path = log_path(home, RUN, "train", attempt, "stdout" if stream == "out" else "stderr")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


async def tail(stub: pb_grpc.NodeServiceAsyncStub, **fields: object) -> list[pb.LogChunk]:
    request = pb.TailLogRequest(task_id=TASK, attempt=1)
    for name, value in fields.items():
        setattr(request, name, value)
    return [chunk async for chunk in stub.TailLog(request)]


async def next_chunk(call: object) -> pb.LogChunk | None:
    """The next chunk of a streaming call read step by step; None at its end."""
    got = await asyncio.wait_for(call.read(), 5)  # type: ignore[attr-defined]
    return got if isinstance(got, pb.LogChunk) else None


def test_the_api_reads_the_files_the_agent_writes(tmp_path: Path) -> None:
    cmd = StartTask(at=0.0, task_id=TASK, run_id=RUN, step="train", attempt=3,
                    step_type="cpu", command="true")
    paths = task_paths(tmp_path, cmd)
    assert log_path(tmp_path, RUN, "train", 3, "stdout") == paths.stdout
    assert log_path(tmp_path, RUN, "train", 3, "stderr") == paths.stderr


async def test_a_finished_tasks_logs_come_whole_stdout_then_stderr(
        stub: pb_grpc.NodeServiceAsyncStub, tmp_path: Path) -> None:
    write(tmp_path, "out", b"hello\n")
    write(tmp_path, "err", b"oops\n")
    chunks = await tail(stub)
    assert [(c.stream, c.data, c.offset) for c in chunks] == [
        ("stdout", b"hello\n", 0), ("stderr", b"oops\n", 0)]
    only = await tail(stub, stream="stderr", tail_bytes=3)
    assert [(c.stream, c.data, c.offset) for c in only] == [("stderr", b"ps\n", 2)]


async def test_follow_streams_new_output_until_the_attempt_stops_running(
        stub: pb_grpc.NodeServiceAsyncStub, tmp_path: Path, running: Running) -> None:
    path = write(tmp_path, "out", b"start\n")
    write(tmp_path, "err", b"")
    running.now.add((TASK, 1))
    call = stub.TailLog(pb.TailLogRequest(task_id=TASK, attempt=1, follow=True,
                                          stream="stdout"))
    first = await next_chunk(call)
    assert first is not None
    assert first.data == b"start\n"
    with path.open("ab") as out:
        out.write(b"more\n")
    second = await next_chunk(call)
    assert second is not None
    assert (second.data, second.offset) == (b"more\n", 6)
    with path.open("ab") as out:
        out.write(b"the end\n")
    running.now.clear()
    rest: list[bytes] = []
    while (chunk := await next_chunk(call)) is not None:
        rest.append(chunk.data)
    assert b"".join(rest) == b"the end\n"


@pytest.mark.parametrize(("fields", "message"), [
    ({"task_id": "train"}, "not a task id"),
    ({"task_id": f"{RUN}/../etc"}, "not a task id"),
    ({"attempt": 0}, "attempt must be 1 or more"),
    ({"tail_bytes": -1}, "must not be negative"),
    ({"stream": "stdin"}, "stdout, stderr or both"),
])
async def test_bad_requests_are_invalid_arguments(stub: pb_grpc.NodeServiceAsyncStub,
                                                  fields: dict[str, object],
                                                  message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tail(stub, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")


async def test_missing_logs_are_not_found_and_say_what_was_looked_for(
        stub: pb_grpc.NodeServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tail(stub, attempt=4)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    details = info.value.details() or ""
    assert details.startswith(f"node node-7 has no stdout or stderr log of {TASK} attempt 4 "
                              "(no log file ")
    assert details.endswith(f"/runs/{RUN}/logs/train.4.out)")


async def test_a_log_replaced_by_a_symlink_is_refused(stub: pb_grpc.NodeServiceAsyncStub,
                                                      tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("private")
    path = log_path(tmp_path, RUN, "train", 1, "stdout")
    path.parent.mkdir(parents=True)
    path.symlink_to(secret)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tail(stub, stream="stdout")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "symbolic link" in (info.value.details() or "")


class FakeRunner:
    def task_holdings(self) -> tuple[TaskHolding, ...]:
        return (TaskHolding(task_id=TASK, attempt=2),)


def test_running_means_this_very_attempt_is_alive_here() -> None:
    check = running_check(FakeRunner())  # type: ignore[arg-type]
    assert check(TASK, 2)
    assert not check(TASK, 1)
    assert not check(f"{RUN}/other", 2)


def test_a_request_becomes_a_query() -> None:
    query = tail_query(pb.TailLogRequest(task_id=TASK, attempt=2, stream="stderr",
                                         follow=True, tail_bytes=10))
    assert (query.run_id, query.step, query.attempt, query.streams, query.follow,
            query.tail_bytes) == (RUN, "train", 2, ("stderr",), True, 10)
