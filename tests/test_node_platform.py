"""Driver, CUDA and GPU-model uniformity and requirements end to end: three real node-agents
on simulated GPUs that claim a model and versions (`--gpus sim:1,model=…,driver=…,cuda=…`),
the real scheduler and orchestrator, and the `m27` command line.

- each agent registers its driver, CUDA and NVML versions; `m27 nodes` shows them and marks
  the node that differs from most;
- the scheduler reports that node as a `node_platform_differs` event (what notifications
  route), once;
- a step that requires a GPU model or a CUDA version runs only where it holds; one that no
  node meets is refused at submission, and one that only a cordoned node meets waits with a
  reason naming what each node misses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client, PipelineRejected
from tests.scheduling_support import m27_cli, start_agent
from tests.support import Cluster, finished_run

pytestmark = pytest.mark.integration

NEW = "sim:1,model=A100-SXM4-80GB,driver=550.54.15,cuda=12.4"
OLD = "sim:1,model=A10G,driver=535.104.05,cuda=12.2"
DIFFERS = "driver 535.104.05, most nodes 550.54.15 (2 of 3)"


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "system", nodes=0, env={"M27_SCHEDULER_TICK": "0.5s"})
    cluster.start()
    for node, gpus in (("node-1", NEW), ("node-2", NEW), ("node-3", OLD)):
        start_agent(cluster, node, gpus)
    yield cluster
    cluster.stop()


def cli(system: Cluster, *args: str) -> str:
    result = m27_cli(system, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def poll(what: str, check: object, timeout: float = 30.0) -> str:
    """The output of `check()` once it is non-empty; an assertion naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()  # type: ignore[operator]
        if found:
            return str(found)
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def platform_events(system: Cluster) -> list[dict[str, object]]:
    out = cli(system, "events", "--json")
    return [e for e in map(json.loads, out.splitlines())
            if e.get("type") == "node_platform_differs"]


async def test_versions_are_shown_the_odd_node_is_reported_and_requirements_place_work(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    nodes = {n.node_id: n for n in await client.list_nodes()}
    assert (nodes["node-1"].driver_version, nodes["node-1"].cuda_version) == (
        "550.54.15", "12.4")
    assert nodes["node-3"].platform_differences == (
        DIFFERS, "cuda 12.2, most nodes 12.4 (2 of 3)")
    assert nodes["node-1"].platform_differences == ()
    shown = cli(system, "nodes")
    assert "GPUs: 1 x m27 simulated GPU (A10G); driver 535.104.05, CUDA 12.2" in shown, shown
    assert f"DIFFERS: {DIFFERS}" in shown, shown

    # The scheduler reports node-3, once (node-1 and node-2 agree with most nodes).
    await poll("no node_platform_differs event", lambda: platform_events(system))
    events = platform_events(system)
    assert [e["node_id"] for e in events] == ["node-3"], events
    assert DIFFERS in events[0]["differences"]  # type: ignore[operator]
    assert "platform differs: " + DIFFERS in cli(system, "events")

    work = tmp_path / "work"
    work.mkdir()
    placed = await client.submit(
        "pipeline:\n"
        "  - {name: new, command: 'true', resources: {gpus: 1, cuda: '>=12.3'}}\n"
        "  - {name: a10, command: 'true', resources: {gpus: 1, gpu_model: A10G}}\n"
        "  - {name: a100, command: 'true', resources: {gpus: 1, gpu_model: 'A100 80GB',"
        " driver: '550'}}\n", workdir=str(work))
    run = await finished_run(client, placed)
    assert run.state == "succeeded"
    where = {s.name: s.node_id for s in run.steps}
    assert where["a10"] == "node-3"
    assert where["new"] in {"node-1", "node-2"}
    assert where["a100"] in {"node-1", "node-2"}

    # A requirement no node meets is refused at submission, naming what each node misses.
    with pytest.raises(PipelineRejected, match=r"node-3: cuda 12\.2, needs >=13"):
        await client.submit("pipeline:\n  - {name: future, command: 'true', "
                            "resources: {gpus: 1, cuda: '>=13'}}\n", workdir=str(work))
    # One only a cordoned node meets waits, and says why.
    cli(system, "node", "cordon", "node-3")
    waiting = await client.submit(
        "pipeline:\n  - {name: a10, command: 'true', resources: {gpus: 1, gpu_model: A10G}}\n",
        workdir=str(work))
    reason = await poll("no wait reason for the step no node meets", lambda: next(
        (line for line in cli(system, "queue", "--explain").splitlines()
         if "no node meets its requirements" in line), ""))
    assert "node-1: GPUs m27 simulated GPU (A100-SXM4-80GB)" in reason, reason
    cli(system, "node", "uncordon", "node-3")
    done = await finished_run(client, waiting)
    assert (done.state, done.steps[0].node_id) == ("succeeded", "node-3")
