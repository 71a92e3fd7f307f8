"""A maintenance window end to end, with two real node-agents on simulated GPUs, the real
scheduler and the `m27` command line: at its start the node is cordoned and emptied (the
checkpointing step checkpoints and moves to the other node, resuming there), its agent runs
the command, and the node takes work again; a window whose command fails leaves the node
cordoned. Every phase is an event."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.client.scheduler import NodeMaintenance, SchedulerClient
from tests.scheduling_support import (
    COUNTER,
    agent_system,
    counts,
    m27_cli,
    scheduler_address,
    wait_step,
)
from tests.support import Cluster, finished_run, lines, wait_for

pytestmark = pytest.mark.integration

MOVABLE = ("priority: high\npreemptible: true\npipeline:\n"
           "  - {name: md, type: gpu, command: '\"$M27_PYTHON\" counter.py md 150'}\n")
LEAD_S = 4.0


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1", "node-2")


def ok(system: Cluster, *args: str) -> str:
    result = m27_cli(system, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def window_events(system: Cluster, node: str) -> list[str]:
    out = ok(system, "events", "--json")
    return [e["phase"] for e in map(json.loads, out.splitlines())
            if e.get("type") == "node_maintenance_window" and e.get("node_id") == node]


async def test_a_window_drains_the_node_runs_its_command_and_returns_it(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "counter.py").write_text(COUNTER)
    marker = tmp_path / "gpu-reset-done"
    run_id = await client.submit(MOVABLE, workdir=str(work))
    md = await wait_step(client, run_id, "md", lambda s: s.state == "running", "no start")
    node, other = md.node_id or "", "node-2" if md.node_id == "node-1" else "node-1"
    await wait_for(lambda: len(counts(work / "md.log", 1)) >= 5, "md does not count")

    asked = time.time()
    shown = ok(system, "node", "maintain", node, "--in", f"{LEAD_S:.0f}s", "--tz", "UTC",
               "--command", f"echo resetting GPUs; touch {marker}")
    at, day = re.search(r"once at (\S+) on (\S+) UTC", shown).groups()  # type: ignore[union-attr]
    start = dt.datetime.fromisoformat(f"{day}T{at}+00:00").timestamp()
    assert asked + LEAD_S <= start <= time.time() + LEAD_S + 1, shown
    assert "command: echo resetting GPUs" in shown
    listed = json.loads(ok(system, "node", "windows", "--json"))
    assert [(w["node_id"], w["phase"]) for w in listed] == [(node, "scheduled")]

    await wait_for(marker.exists, "the window's command did not run", timeout=90)
    await wait_for(lambda: window_events(system, node)[-1:] == ["succeeded"],
                   "no succeeded event", timeout=30)
    assert window_events(system, node) == ["draining", "running", "succeeded"]
    assert json.loads(ok(system, "node", "windows", "--json")) == []  # a once window is over
    assert node not in await maintenance(system)  # back in service

    run = await finished_run(client, run_id, timeout=120)
    assert run.state == "succeeded", system.logs()
    step = run.steps[0]
    assert (step.attempt, step.node_id, step.history[0].node_id) == (2, other, node)
    assert step.history[0].cause == "preempted"
    assert "maintenance window on" in step.history[0].reason
    saved = [line for line in lines(work / "md.log") if line.startswith("1 checkpoint ")]
    resumed_at = int(saved[0].split()[2])
    assert counts(work / "md.log", 2) == list(range(resumed_at + 1, 151)), "work redone"


async def test_a_failing_command_leaves_the_node_cordoned_and_says_why(
        system: Cluster, client: Client) -> None:
    ok(system, "node", "maintain", "node-2", "--in", "5s",
       "--command", "echo driver busy >&2; exit 7", "--command-timeout", "30s")
    await wait_for(lambda: window_events(system, "node-2")[-1:] == ["failed"],
                   "no failed event", timeout=60)
    failed = [e for e in map(json.loads, ok(system, "events", "--json").splitlines())
              if e.get("type") == "node_maintenance_window" and e.get("phase") == "failed"]
    assert failed[-1]["exit_code"] == 7
    assert "driver busy" in failed[-1]["output_tail"]
    assert "exited with 7" in failed[-1]["detail"]
    marks = await maintenance(system)
    assert marks["node-2"].state == "cordoned"
    assert "failed: the command exited with 7" in marks["node-2"].reason
    # work goes to node-1 only, until a person returns node-2
    quick = await client.submit("pipeline:\n  - {name: q, type: gpu, command: 'true'}\n")
    done = await finished_run(client, quick)
    assert done.steps[0].node_id == "node-1"
    ok(system, "node", "uncordon", "node-2")
    assert "node-2" not in await maintenance(system)


async def maintenance(system: Cluster) -> dict[str, NodeMaintenance]:
    async with SchedulerClient(scheduler_address(system), access=system.access) as client:
        return {m.node_id: m for m in await client.maintenance() if m.state}


def test_a_window_that_cannot_be_set_is_refused_naming_what(system: Cluster) -> None:
    for args, said in (
            (("--at", "25:00"), "HH:MM"), (("--at", "03:00", "--tz", "Mars/Olympus"),
                                          "not known"),
            (("--at", "03:00", "--on", "2020-01-01", "--tz", "UTC"), "over already")):
        result = m27_cli(system, "node", "maintain", "node-1", *args)
        assert result.returncode != 0
        assert said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    for args, said in ((("--in", "1h", "--at", "03:00"), "not with --at"),
                       (("--in", "400d"), "--in: between"), (("--in", "soon"), "--in:")):
        result = m27_cli(system, "node", "maintain", "node-1", *args)
        assert result.returncode != 0
        assert said in result.stderr, result.stderr
    unknown = m27_cli(system, "node", "maintain", "node-9", "--at", "03:00")
    assert unknown.returncode != 0
    assert "no node 'node-9'" in unknown.stderr
