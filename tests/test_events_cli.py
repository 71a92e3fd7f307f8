"""`m27 events` and `WatchEvents` on the real system: a run's events from its submission to
its end in stream order, as JSON lines for jq; another user's run refused; a user's feed
without a run holds node events and their own runs only; a follow ends on Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from m27.client import BusEvent, Client, ClientError
from m27.common.events import RunSubmitted
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc
from tests.support import Cluster, finished_run, wait_for

pytestmark = pytest.mark.integration

TWO_STEPS = "pipeline:\n  - {name: a, command: 'true'}\n  - {name: b, depends_on: [a], " \
            "command: 'true'}\n"


def m27(cluster: Cluster, *args: str, token: str = "") -> tuple[list[str], dict[str, str]]:
    """The command line against the cluster's API and its environment: as the admin (the
    token `m27 up` wrote), or with `token`."""
    env = {k: v for k, v in cluster.env.items() if k != "M27_API"}
    if token:
        env["M27_TOKEN"] = token
    return [sys.executable, "-m", "m27.cli", "--api", cluster.api, *args], env


def run_cli(cluster: Cluster, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
    argv, env = m27(cluster, *args, token=token)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Client]:
    async with cluster.client() as connected:
        yield connected


@pytest.fixture
async def run_id(client: Client, tmp_path: Path) -> str:
    """A two-step run of the admin's, finished."""
    submitted = await client.submit(TWO_STEPS, workdir=str(tmp_path))
    assert (await finished_run(client, submitted, timeout=30)).state == "succeeded"
    return submitted


async def test_a_runs_events_are_listed_in_order_as_json_lines(cluster: Cluster, client: Client,
                                                               run_id: str) -> None:
    done = await asyncio.to_thread(run_cli, cluster, "events", "--run", run_id, "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0]["type"] == "run_submitted"
    assert [e["seq"] for e in lines] == sorted({e["seq"] for e in lines})
    assert all(run_id in e["subject"] for e in lines)
    ends = [e["state"] for e in lines if e["type"] == "run_state_changed"]
    assert ends[-1] == "succeeded"
    assert [(e["step"], e["state"]) for e in lines if e["type"] == "step_state_changed"
            and e["state"] == "succeeded"] == [("a", "succeeded"), ("b", "succeeded")]
    assert {"task_started", "task_exited"} <= {e["type"] for e in lines}
    latest = [e.sequence async for e in client.events(run_id, limit=2)]
    assert latest == [e["seq"] for e in lines[-2:]]


async def test_another_users_run_is_refused_and_their_feed_holds_none_of_it(
        cluster: Cluster, run_id: str, tmp_path: Path) -> None:
    """mallory may not follow the admin's run; her feed of everything holds node events
    and her own run's, nothing of the admin's."""
    mallory = cluster.access_as("mallory")
    async with mallory.channel(cluster.api) as channel:
        stub = pb_grpc.PipelineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.WatchEvents(pb.WatchEventsRequest(run_id=run_id)):
                pass
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            async for _ in stub.WatchEvents(pb.WatchEventsRequest(
                    run_id="r-20200101-000000-abcdef")):
                pass
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    async with cluster.client(mallory) as theirs:
        hers = await theirs.submit("pipeline:\n  - {name: a, command: 'true'}\n",
                                   workdir=str(tmp_path))
        await finished_run(theirs, hers, timeout=30)
        seen = [e async for e in theirs.events(limit=1000)]
    runs = {e.subject.split(".")[3] for e in seen if not e.subject.startswith("m27.events.node.")}
    assert runs == {hers}
    assert "node_registered" in {json.loads(e.event_json)["type"] for e in seen}
    cli = await asyncio.to_thread(run_cli, cluster, "events", "--run", run_id,
                                  token=str(mallory.token))
    assert cli.returncode == 1
    assert cli.stderr == (f"m27: run {run_id} belongs to another user: only they or an "
                          "admin may see it\n")


async def test_a_follow_goes_on_with_new_events_until_the_client_stops(
        client: Client, tmp_path: Path) -> None:
    seen: list[BusEvent] = []
    started = asyncio.Event()

    async def follow() -> None:
        async for item in client.events(limit=1, follow=True):
            seen.append(item)
            started.set()

    def submitted(run_id: str) -> bool:
        return any(isinstance(e.event, RunSubmitted) and e.event.run_id == run_id
                   for e in seen)

    following = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(started.wait(), 10)  # the latest event: its consumer is there
        run_id = await client.submit(TWO_STEPS, workdir=str(tmp_path))
        await wait_for(lambda: submitted(run_id), "the new run's events", timeout=10)
    finally:
        following.cancel()
    with pytest.raises(asyncio.CancelledError):
        await following
    assert seen[0].sequence < seen[-1].sequence
    with pytest.raises(ClientError, match="limit must be between 1 and 5000"):
        [e async for e in client.events(limit=10_000)]


def test_ctrl_c_ends_a_follow_quietly(cluster: Cluster) -> None:
    argv, env = m27(cluster, "events", "--follow")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip()  # streaming: node-1 registered at least
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
