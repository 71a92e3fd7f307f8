"""A clustered NATS (issue 17, point 5): `m27 up --nats-cluster 3` runs three nats-servers as
one JetStream cluster with R3 streams and buckets, the services and two node-agents spread
over them; one server is killed (SIGKILL) while pipelines run and started again later.
Every run succeeds, nothing acknowledged is lost, no step runs twice.

The longer version (several kills, the meta leader, the stream leader, more runs) is
bench/nats_cluster_chaos.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.common.bus import NatsBus, connect, topology_names
from m27.common.errors import BusError
from m27.embedded import NatsServer
from m27.embedded.nats_cluster import free_ports
from tests.nats_cluster_support import (
    PIPELINE,
    Clustered,
    Probe,
    clustered,
    finished,
    leader,
    marks,
    overlapping,
    replicas_current,
)
from tests.support import finished_run, stored

pytestmark = pytest.mark.integration

RUNS = 4


async def test_a_client_given_several_servers_takes_the_first_that_answers(
        tmp_path: Path) -> None:
    first, second = NatsServer(tmp_path / "a"), NatsServer(tmp_path / "b")
    first.start()
    second.start()
    try:
        a, b = first.url or "", second.url or ""
        dead = f"nats://127.0.0.1:{free_ports(1)[0]}"
        for url, expected in ((f"{a},{b}", a), (f"{b}, {a}", b), (f"{dead},{b}", b)):
            nc = await connect(url, name="test", timeout=5)
            try:
                assert nc.connected_url is not None
                assert f"{nc.connected_url.hostname}:{nc.connected_url.port}" in expected
            finally:
                await nc.close()
        with pytest.raises(BusError, match=rf"cannot reach NATS at {dead} within 1s"):
            await connect(dead, name="test", timeout=1)
    finally:
        first.stop()
        second.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Clustered]:
    with clustered(tmp_path) as system:
        yield system


async def test_runs_survive_a_nats_server_killed_and_brought_back(
        cluster: Clustered, tmp_path: Path) -> None:
    state = cluster.state
    assert [n.name for n in state.nats_servers] == [f"nats-server-{i}" for i in (1, 2, 3)]
    # Two agents on different servers: each is given the servers in another order.
    first_urls = {p.name: Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
                  for p in state.processes}
    firsts = {name: args[args.index(b"--nats") + 1].split(b",")[0]
              for name, args in first_urls.items()}
    assert firsts["node-agent-1"] != firsts["node-agent-2"]
    assert len(set(firsts.values())) == 3
    bus = await cluster.admin()
    probe = Probe(bus)
    try:
        for name in topology_names():  # every stream and bucket has three replicas
            assert (await bus.js.stream_info(name)).config.num_replicas == 3, name
        work = tmp_path / "work"
        work.mkdir()
        await probe.start()
        async with cluster.client() as client:
            runs = [await client.submit(PIPELINE, workdir=str(work), no_cache=True)
                    for _ in range(RUNS)]
            await _some_step_running(client, runs[0])
            victim = await _victim(cluster, bus)
            cluster.kill(victim)
            # The rest runs on two servers; the killed one comes back once a run ends.
            ended = await finished(client, runs[0], timeout=60)
            assert ended.state == "succeeded", cluster.logs()
            done = [await finished(client, run_id, timeout=60) for run_id in runs]
            assert [r.state for r in done] == ["succeeded"] * RUNS, cluster.logs()
            # Read from the survivors alone: every run's events are there.
            events = [subject for subject, _ in await stored(bus, "M27_EVENTS")]
            cluster.revive()
            after = await client.submit(PIPELINE, workdir=str(work), no_cache=True)
            assert (await finished_run(client, after, timeout=60)).state == "succeeded"
        await probe.stop()
        for run in done:
            mine = [s for s in events if f".{run.run_id}." in s]
            assert f"m27.events.run.{run.run_id}.state" in mine
            for step in ("prep", "train", "eval"):
                assert any(s.startswith(f"m27.events.task.{run.run_id}.{step}.node-")
                           for s in mine), (run.run_id, step)
            assert [s.attempt for s in run.steps] == [1, 1, 1], run.steps
        counts = await replicas_current(bus)  # the revived server caught up on everything
        assert counts["M27_EVENTS"] >= len(events)
        assert probe.acked
        assert await probe.lost() == [], "an acknowledged write was lost"
        found = marks(work)
        ran = Counter(m.task for m in found)
        assert len(ran) == 3 * (RUNS + 1), ran
        assert set(ran.values()) == {1}, ran
        assert all(m.end is not None for m in found)
        assert overlapping(found) == []
        assert {m.node for m in found} == {"node-1", "node-2"}
    finally:
        await probe.stop()
        await bus.close()


async def _victim(cluster: Clustered, bus: NatsBus) -> int:
    """The server leading M27_COMMANDS, the hardest one to lose: a start command the
    scheduler fails to publish during that election must be sent again (the placement
    was stored first), or its run waits for good."""
    return cluster.server_index(await leader(bus, "M27_COMMANDS"))


async def _some_step_running(client: Client, run_id: str) -> None:
    deadline = time.monotonic() + 30
    while not any(s.state == "running" for s in (await client.get_run(run_id)).steps):
        assert time.monotonic() < deadline, await client.get_run(run_id)
        await asyncio.sleep(0.05)
