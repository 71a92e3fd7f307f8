"""Failover with real agents on simulated GPUs: a dead, cut-off or frozen node's work runs
again elsewhere from its checkpoint, and no two attempts of a task ever run at once.

Leases are shortened for the tests (renewal every 1 s, self-fencing after 3 s, lost after
5 s) so each case takes seconds; the relations between them are the production ones.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.client.checkpoints import CheckpointClient
from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.model import StepRecord
from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import ServiceProcess, wait_ready
from tests.support import Cluster, TcpProxy, finished_run, service_log, wait_for

pytestmark = pytest.mark.integration

LEASE = {"M27_NODE_LEASE_FENCE_AFTER": "3s", "M27_SCHEDULER_NODE_TIMEOUT": "5s"}
WORKER = '''\
import json, os, pathlib, sys, time
state = pathlib.Path(os.environ["M27_CHECKPOINT_DIR"]) / "state.json"
start = json.loads(state.read_text())["i"] if state.exists() else 0
attempt = os.environ["M27_ATTEMPT"]
print(f"attempt {attempt} starts from {start}", flush=True)
with open("alive.log", "a") as alive:
    for i in range(start, int(sys.argv[1])):
        alive.write(f"{attempt} {time.time():.3f} {i}\\n")
        alive.flush()
        time.sleep(0.1)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"i": i + 1}))
        os.replace(tmp, state)
'''
PIPELINE = ('pipeline:\n  - {{name: train, type: gpu, command: \'"$M27_PYTHON" worker.py '
            '{ticks}\'}}\n')


def agent_args(node: str) -> list[str]:
    return ["--node-id", node, "--instance", node, "--gpus", "sim:1",
            "--heartbeat-interval", "1s"]


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "system", nodes=0, env=LEASE)
    cluster.start()
    yield cluster
    for proc in cluster.processes.values():  # a test may leave one stopped
        if pid_alive(proc.pid):
            os.kill(proc.pid, signal.SIGCONT)
    cluster.stop()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    (path / "worker.py").write_text(WORKER)
    return path


def start_agent(cluster: Cluster, node: str, nats_url: str | None = None) -> ServiceProcess:
    args = agent_args(node) + (["--nats", nats_url] if nats_url else [])
    proc = cluster.launch(f"agent-{node}", "m27.node_agent", args)
    wait_ready([proc])
    return proc


async def running_on(client: Client, run_id: str, timeout: float = 30.0) -> StepRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step = (await client.get_run(run_id)).steps[0]
        if step.state == "running":
            return step
        await asyncio.sleep(0.05)
    raise AssertionError(f"step never ran: {await client.get_run(run_id)}")


async def wait_ticks(work: Path, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    log = work / "alive.log"
    while not (log.exists() and len(log.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, "the worker does not tick"
        await asyncio.sleep(0.05)


def spans(work: Path) -> dict[str, tuple[float, float]]:
    """attempt → (first, last) time it was seen alive."""
    seen: dict[str, list[float]] = {}
    for line in (work / "alive.log").read_text().splitlines():
        attempt, stamp, _ = line.split()
        seen.setdefault(attempt, []).append(float(stamp))
    return {a: (min(t), max(t)) for a, t in seen.items()}


def assert_never_overlapped(work: Path) -> None:
    ordered = sorted(spans(work).values())
    for (_, end), (start, _) in itertools.pairwise(ordered):
        assert end < start, f"two attempts ran at once: {spans(work)}"


async def test_a_killed_agents_step_runs_again_elsewhere_from_its_checkpoint(
        system: Cluster, client: Client, work: Path) -> None:
    first = start_agent(system, "a")
    run_id = await client.submit(PIPELINE.format(ticks=80), workdir=str(work))
    await running_on(client, run_id)
    second = start_agent(system, "b")
    await wait_ticks(work, 10)
    killed_at = time.time()
    os.kill(first.pid, signal.SIGKILL)
    run = await finished_run(client, run_id)
    assert run.state == "succeeded", system.logs()
    step = run.steps[0]
    assert (step.attempt, step.node_id) == (2, "b")
    assert step.history[0].cause == "lost"
    assert step.history[0].node_id == "a"
    resumed = int(step.stdout_tail.split("starts from ")[1].split()[0])
    assert resumed >= 10, step.stdout_tail
    assert_never_overlapped(work)
    assert spans(work)["2"][0] - killed_at < 12  # lease 5 s + placement + start
    assert pid_alive(second.pid)


async def test_a_cut_off_node_fences_itself_before_its_work_restarts_elsewhere(
        system: Cluster, client: Client, work: Path) -> None:
    proxy = TcpProxy("127.0.0.1", int(system.nats_url.rsplit(":", 1)[1]))
    try:
        start_agent(system, "a", nats_url=proxy.url)
        run_id = await client.submit(PIPELINE.format(ticks=100), workdir=str(work))
        await running_on(client, run_id)
        start_agent(system, "b")
        await wait_ticks(work, 10)
        proxy.cut()
        cut_at = time.time()
        run = await finished_run(client, run_id)
        assert run.state == "succeeded", system.logs()
        first_end, _ = spans(work)["1"][1], None
        assert first_end - cut_at < 4.5  # fenced by its own lease (3 s), not by luck
        assert_never_overlapped(work)
        assert run.steps[0].attempt == 2
        proxy.heal()
        # node a comes back (its connection is restored): nothing of attempt 1 runs or counts
        agent_a = system.processes["agent-a"]
        await wait_for(lambda: "nats.reconnected" in service_log(agent_a),
                       "agent a never reconnected after the heal", timeout=30)
        again = await client.get_run(run_id)
        assert again.steps[0].attempt == 2
        assert again.state == "succeeded"
    finally:
        proxy.close()


async def test_a_frozen_agents_stale_attempt_is_killed_and_its_writes_refused(
        system: Cluster, client: Client, work: Path) -> None:
    frozen = start_agent(system, "a")
    run_id = await client.submit(PIPELINE.format(ticks=90), workdir=str(work))
    await running_on(client, run_id)
    start_agent(system, "b")
    await wait_ticks(work, 10)
    os.kill(frozen.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while (step := (await client.get_run(run_id)).steps[0]).attempt < 2 \
            or step.state != "running":
        assert time.monotonic() < deadline, system.logs()
        await asyncio.sleep(0.1)
    task = f"{run_id}/train"
    checkpoint_address = system.processes["checkpoint-store"].grpc_address
    async with system.access.channel(checkpoint_address) as channel:
        stale = CheckpointClient(channel)
        with pytest.raises(Exception, match=r"attempt 1 of .* is stale"):
            await stale.put_bytes(task, b"from the frozen node", attempt=1, name="late")
        fresh = await stale.put_bytes(task, b"from the replacement", attempt=2, name="ok")
        assert fresh.attempt == 2
    os.kill(frozen.pid, signal.SIGCONT)
    run = await finished_run(client, run_id)
    assert run.state == "succeeded", system.logs()
    assert run.steps[0].attempt == 2
    assert_never_overlapped(work)


async def test_a_two_second_stall_is_not_a_failure(system: Cluster, client: Client,
                                                   work: Path) -> None:
    agent = start_agent(system, "a")
    start_agent(system, "b")
    bus = await NatsBus.open(system.nats_url, name="test")
    lost: list[str] = []

    async def on_node_event(msg: object) -> None:
        event = events.decode_event(msg.data)  # type: ignore[attr-defined]
        if isinstance(event, events.NodeLost):
            lost.append(event.node_id)

    await bus.nc.subscribe(subjects.NODE_EVENTS_ALL, cb=on_node_event)
    try:
        run_id = await client.submit(PIPELINE.format(ticks=40), workdir=str(work))
        step = await running_on(client, run_id)
        await wait_ticks(work, 5)
        paused = agent if step.node_id == "a" else system.processes["agent-b"]
        os.kill(paused.pid, signal.SIGSTOP)
        await asyncio.sleep(2.0)
        os.kill(paused.pid, signal.SIGCONT)
        run = await finished_run(client, run_id)
        assert run.state == "succeeded"
        assert run.steps[0].attempt == 1
        assert lost == []
    finally:
        await bus.close()
