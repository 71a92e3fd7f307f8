"""Node maintenance end to end, with two real node-agents on simulated GPUs, driven through
the `m27` command line.

- `m27 node cordon` keeps new work off a node (the task waits rather than go there) and is
  shown by `m27 nodes`; the mark survives a scheduler restart.
- `m27 node drain` checkpoints the checkpointing task running on the node, and it moves to
  the other node, resuming from its checkpoint; the drained node then reports empty.
- `m27 node uncordon` makes the node take work again.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.embedded.processes import stop, wait_ready
from tests.scheduling_support import (
    COUNTER,
    agent_system,
    counts,
    m27_cli,
    queue,
    step_of,
    wait_step,
)
from tests.support import Cluster, finished_run, lines, wait_for

pytestmark = pytest.mark.integration

#: high priority: the normal-priority steps of the test wait for it rather than preempt it;
#: its first attempt counts to 40 and waits there to be drained, however slow the machine
MOVABLE = ("priority: high\npreemptible: true\npipeline:\n"
           "  - {name: md, type: gpu, command: '\"$M27_PYTHON\" counter.py md 80 40'}\n")
SHORT = "pipeline:\n  - {name: quick, type: gpu, command: 'sleep 0.5'}\n"


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1", "node-2")


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return str(result.stdout)


def restart_scheduler(system: Cluster) -> None:
    stop([system.processes["scheduler"]])
    wait_ready([system.launch("scheduler", "m27.scheduler")])


async def test_cordon_drain_and_uncordon_move_work_between_nodes(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "counter.py").write_text(COUNTER)
    assert "node-2: cordoned (kernel update)" in ok(
        m27_cli(system, "node", "cordon", "node-2", "--reason", "kernel update"))
    nodes = ok(m27_cli(system, "nodes"))
    assert any(line.startswith("node-2") and "up/cordoned" in line
               for line in nodes.splitlines()), nodes

    movable = await client.submit(MOVABLE, workdir=str(work))
    md = await wait_step(client, movable, "md", lambda s: s.state == "running",
                         "the movable step does not start")
    assert md.node_id == "node-1", "placed on the cordoned node"
    # node-1's only GPU is taken and node-2 is cordoned: the next step waits
    short = await client.submit(SHORT, workdir=str(work))
    waiting = await wait_step(client, short, "quick", lambda s: s.state == "queued",
                              "not queued")
    assert waiting.node_id is None
    restart_scheduler(system)  # the cordon is stored, not only remembered
    await wait_for(lambda: len(counts(work / "md.log", 1)) >= 20, "md does not count")
    # An enqueue the stopped copy had fetched but not acknowledged comes back to the new
    # one after the ack wait (5 s): wait until the new copy lists the step as waiting.
    deadline = time.monotonic() + 30
    while f"{short}/quick" not in (explained := ok(m27_cli(system, "queue", "--explain"))):
        assert time.monotonic() < deadline, explained
        await asyncio.sleep(0.5)
    assert (await client.get_run(short)).state == "queued", "it went to the cordoned node"
    assert "score" in explained, explained

    # Drain node-1 and uncordon node-2: md checkpoints, stops, and moves to node-2 (before
    # the short step, which has the lower priority and runs after it there).
    # `--wait` returns once md has checkpointed and left: the moment a maintenance command
    # (a GPU reset) can run.
    waited = ok(m27_cli(system, "node", "drain", "node-1", "--wait", "--timeout", "50"))
    assert "node-1: draining; empty: a maintenance command can run now" in waited, waited
    # (It says "waiting for 1 task(s) …" first unless md left before its first look.)
    moved = await step_of(client, movable, "md")
    assert (moved.state, moved.attempt) == ("retrying", 2), "drain --wait returned too early"
    ok(m27_cli(system, "node", "uncordon", "node-2"))
    run = await finished_run(client, movable)
    assert run.state == "succeeded", system.logs()
    short_run = await finished_run(client, short)
    assert (short_run.state, short_run.steps[0].node_id) == ("succeeded", "node-2")
    md = run.steps[0]
    assert (md.attempt, md.node_id, md.history[0].node_id) == (2, "node-2", "node-1")
    assert md.history[0].cause == "preempted"
    assert "drain node-1" in md.history[0].reason
    saved = [line for line in lines(work / "md.log") if line.startswith("1 checkpoint ")]
    at = int(saved[0].split()[2])
    assert counts(work / "md.log", 2) == list(range(at + 1, 81)), "work redone or skipped"
    drained = ok(m27_cli(system, "node", "drain", "node-1", "--json"))
    assert '"tasks": 0' in drained, drained

    # Still draining: new work goes elsewhere. Uncordoned: node-1 takes work again.
    blocker = await client.submit(MOVABLE.replace("md 80 40", "md2 100"), workdir=str(work))
    await wait_step(client, blocker, "md", lambda s: s.state == "running", "no start")
    assert (await client.get_run(blocker)).steps[0].node_id == "node-2"
    ok(m27_cli(system, "node", "uncordon", "node-1"))
    after = await client.submit(SHORT, workdir=str(work))
    done = await finished_run(client, after)
    assert (done.state, done.steps[0].node_id) == ("succeeded", "node-1")
    assert not [i for i in await queue(system) if i.task_id == f"{after}/quick"]
    unknown = m27_cli(system, "node", "cordon", "node-9")
    assert unknown.returncode == 1
    assert "node-9" in unknown.stderr
