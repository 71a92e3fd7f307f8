"""The cluster as people look at it, on the real system: `m27 nodes` / ListNodes with GPUs
and who holds them, and step logs through the orchestrator (`StreamLogs`, `m27 logs`),
finished or followed live, relayed from the node-agent or read locally when it is gone."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import msgspec
import pytest

from m27.client import Client, ClientError, LogChunk, NodeStatus
from m27.common import subjects
from m27.common.bus import NatsBus
from m27.common.model import RunRecord, ServiceInfo
from m27.v1 import cluster_pb2 as pb
from m27.v1 import cluster_pb2_grpc as pb_grpc
from tests.support import Cluster

pytestmark = pytest.mark.integration

AGENT_KEY = subjects.service_key("node-agent", "node-1")


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Client]:
    async with cluster.client() as connected:
        yield connected


async def until_state(client: Client, run_id: str, step: str, states: set[str],
                      timeout: float = 30.0) -> RunRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = await client.get_run(run_id)
        found = run.step(step)
        if found is not None and found.state in states:
            return run
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id}/{step} never reached {states}: {run}")


async def node_1(client: Client) -> NodeStatus:
    nodes = {n.node_id: n for n in await client.list_nodes()}
    return nodes["node-1"]


async def logs(client: Client, run_id: str, step: str, **options: object) -> list[LogChunk]:
    return [c async for c in client.stream_logs(run_id, step, **options)]  # type: ignore[arg-type]


def text(chunks: list[LogChunk], stream: str) -> str:
    return b"".join(c.data for c in chunks if c.stream == stream).decode()


async def test_nodes_shows_node_1_with_its_simulated_gpus_and_what_a_gpu_step_holds(
        client: Client, tmp_path: Path) -> None:
    run_id = await client.submit("pipeline:\n  - {name: hold, type: gpu, command: 'sleep 30'}"
                                 "\n", workdir=str(tmp_path))
    try:
        await until_state(client, run_id, "hold", {"running"})
        deadline = time.monotonic() + 10
        node = await node_1(client)
        while not any(g.holdings for g in node.gpus):  # the next heartbeat reports it
            assert time.monotonic() < deadline, node
            await asyncio.sleep(0.2)
            node = await node_1(client)
    finally:
        await client.cancel(run_id, "test over")
    assert (node.state, node.backend, node.cpu_slots > 0) == ("up", "simulated", True)
    assert node.heartbeat_age_s < 5
    assert [(g.index, g.simulated) for g in node.gpus] == [(0, True), (1, True)]
    assert all(g.memory_total_mb > 0 for g in node.gpus)
    held = [h for g in node.gpus for h in g.holdings]
    assert [(h.task_id, h.attempt, h.share) for h in held] == [(f"{run_id}/hold", 1, 1.0)]


async def test_the_logs_of_a_finished_step_come_back_whole_or_as_their_tail(
        client: Client, tmp_path: Path) -> None:
    run_id = await client.submit(
        "pipeline:\n  - {name: talk, command: 'echo hello out; echo to err >&2; echo bye'}\n",
        workdir=str(tmp_path))
    await until_state(client, run_id, "talk", {"succeeded"})
    chunks = await logs(client, run_id, "talk")
    assert text(chunks, "stdout") == "hello out\nbye\n"
    assert text(chunks, "stderr") == "to err\n"
    tail = await logs(client, run_id, "talk", stream="stdout", tail_bytes=4, attempt=1)
    assert [(c.stream, c.data, c.offset) for c in tail] == [("stdout", b"bye\n", 10)]


async def test_each_node_agent_serves_its_own_logs(client: Client, cluster: Cluster,
                                                   tmp_path: Path) -> None:
    run_id = await client.submit("pipeline:\n  - {name: a, command: 'echo from the node'}\n",
                                 workdir=str(tmp_path))
    await until_state(client, run_id, "a", {"succeeded"})
    bus = await NatsBus.open(cluster.nats_url, name="test-cluster-view")
    try:
        got = await bus.kv_get(subjects.SERVICES_BUCKET, AGENT_KEY, ServiceInfo)
    finally:
        await bus.close()
    assert got is not None
    async with cluster.access_as("orchestrator", "node").channel(got[0].grpc_address) as channel:
        stub = pb_grpc.NodeServiceStub(channel)
        chunks = [c async for c in stub.TailLog(pb.TailLogRequest(
            task_id=f"{run_id}/a", attempt=1, stream="stdout"))]
    assert [(c.stream, c.data) for c in chunks] == [("stdout", b"from the node\n")]


async def test_following_a_running_step_streams_lines_as_they_come_and_ends_with_it(
        client: Client, tmp_path: Path) -> None:
    command = "for i in 1 2 3 4 5; do echo line $i; sleep 0.25; done"
    run_id = await client.submit(f"pipeline:\n  - {{name: count, command: '{command}'}}\n",
                                 workdir=str(tmp_path))
    await until_state(client, run_id, "count", {"running"})
    arrivals: list[tuple[float, bytes]] = []
    async for chunk in client.stream_logs(run_id, "count", follow=True, stream="stdout"):
        arrivals.append((time.monotonic(), chunk.data))
    ended = time.monotonic()
    assert b"".join(d for _, d in arrivals) == b"".join(b"line %d\n" % i for i in range(1, 6))
    assert len(arrivals) >= 3  # not one chunk at the end
    assert ended - arrivals[0][0] >= 0.4  # the first line came while the step still ran
    # the agent ends the follow when the process ends; the run learns it from its exit event
    await until_state(client, run_id, "count", {"succeeded"})


async def test_follow_waits_for_a_step_that_has_not_started(client: Client,
                                                             tmp_path: Path) -> None:
    text_ = "pipeline:\n  - {name: first, command: 'sleep 1'}\n" \
            "  - {name: second, command: 'echo late', depends_on: [first]}\n"
    run_id = await client.submit(text_, workdir=str(tmp_path))
    chunks = await asyncio.wait_for(logs(client, run_id, "second", follow=True), 30)
    assert text(chunks, "stdout") == "late\n"


async def test_unknown_runs_and_steps_are_not_found(client: Client, cluster: Cluster,
                                                    tmp_path: Path) -> None:
    run_id = await client.submit("pipeline:\n  - {name: train, command: 'true'}\n",
                                 workdir=str(tmp_path))
    await until_state(client, run_id, "train", {"succeeded"})
    async with cluster.access.channel(cluster.api) as channel:
        stub = pb_grpc.ClusterServiceStub(channel)
        for request in (pb.StreamLogsRequest(run_id="r-20000101-000000-000000", step="x"),
                        pb.StreamLogsRequest(run_id=run_id, step="trian"),
                        pb.StreamLogsRequest(run_id=run_id, step="train", attempt=7)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [c async for c in stub.StreamLogs(request)]
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [c async for c in stub.StreamLogs(pb.StreamLogsRequest(run_id="x", step="y"))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ClientError, match=r"has no step 'trian' \(did you mean `train`\?\)"):
        await logs(client, run_id, "trian")


@asynccontextmanager
async def agent_address_replaced(cluster: Cluster, address: str) -> AsyncIterator[None]:
    """node-1's agent as if it were gone: its registration points nowhere for a while."""
    bus = await NatsBus.open(cluster.nats_url, name="test-cluster-view")
    try:
        got = await bus.kv_get(subjects.SERVICES_BUCKET, AGENT_KEY, ServiceInfo)
        assert got is not None
        real = got[0]
        await bus.kv_put(subjects.SERVICES_BUCKET, AGENT_KEY,
                         msgspec.structs.replace(real, grpc_address=address))
        try:
            yield
        finally:
            await bus.kv_put(subjects.SERVICES_BUCKET, AGENT_KEY, real)
    finally:
        await bus.close()


async def test_without_its_node_agent_a_steps_logs_are_read_on_this_machine_if_there(
        client: Client, cluster: Cluster, tmp_path: Path) -> None:
    run_id = await client.submit("pipeline:\n  - {name: said, command: 'echo kept'}\n",
                                 workdir=str(tmp_path))
    await until_state(client, run_id, "said", {"succeeded"})
    async with agent_address_replaced(cluster, "127.0.0.1:1"):
        assert text(await logs(client, run_id, "said"), "stdout") == "kept\n"
        for log in (cluster.home / "runs" / run_id / "logs").iterdir():
            log.unlink()
        with pytest.raises(ClientError) as info:
            await logs(client, run_id, "said")
    message = str(info.value)
    assert message.startswith("the node-agent of node-1 at 127.0.0.1:1 cannot be reached")
    assert "they are on node node-1" in message


class M27:
    """The CLI as a user runs it, pointed at the test's cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.api = cluster.api
        self.env = {**cluster.env}
        self.env.pop("M27_API", None)

    def __call__(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "m27.cli", "--api", self.api, *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def m27(cluster: Cluster) -> M27:
    return M27(cluster)


async def test_the_cli_prints_nodes_and_logs(client: Client, m27: M27, tmp_path: Path) -> None:
    run_id = await client.submit(
        "pipeline:\n  - {name: talk, command: 'echo to out; echo to err >&2'}\n",
        workdir=str(tmp_path))
    await until_state(client, run_id, "talk", {"succeeded"})
    both = await asyncio.to_thread(m27, "logs", run_id, "talk")
    assert (both.returncode, both.stdout, both.stderr) == (0, "to out\n", "to err\n")
    only = await asyncio.to_thread(m27, "logs", run_id, "talk", "--stderr", "--tail", "3")
    assert (only.returncode, only.stdout, only.stderr) == (0, "rr\n", "")
    unknown = await asyncio.to_thread(m27, "logs", run_id, "tlak")
    assert unknown.returncode == 1
    assert unknown.stderr == f"m27: run {run_id} has no step 'tlak' (did you mean `talk`?)\n"
    far = await asyncio.to_thread(m27, "logs", run_id, "zzz")
    assert far.stderr == f"m27: run {run_id} has no step 'zzz' (its steps: talk)\n"
    only_step = await asyncio.to_thread(m27, "logs", run_id)  # a one-step run: that step
    assert (only_step.returncode, only_step.stdout) == (0, "to out\n"), only_step.stderr
    nodes = await asyncio.to_thread(m27, "nodes")
    assert nodes.returncode == 0, nodes.stderr
    assert "node-1" in nodes.stdout
    assert "simulated (not real GPUs)" in nodes.stdout
    listed = json.loads((await asyncio.to_thread(m27, "nodes", "--json")).stdout)
    assert [g["simulated"] for g in listed[0]["gpus"]] == [True, True]
    top = await asyncio.to_thread(m27, "top", "--once")
    assert top.returncode == 0
    assert top.stdout.startswith("m27 top ")


def test_the_cli_says_clearly_when_the_api_is_down(cluster: Cluster) -> None:
    env = {**cluster.env, "M27_HOME": str(cluster.root / "nowhere"),
           "M27_TOKEN": str(cluster.access.token)}  # a valid token: the API is what is missing
    env.pop("M27_API", None)
    done = subprocess.run([sys.executable, "-m", "m27.cli", "--api", "127.0.0.1:1", "nodes"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("m27: cannot reach the m27 API at 127.0.0.1:1")
    assert "Traceback" not in done.stderr
    assert os.path.isdir(cluster.root)
