"""The ready pool end to end, with two real node-agents of one simulated GPU each: while
two whole-GPU steps hold both GPUs, the next whole-GPU step waits, and the scheduler has
both agents read its inputs (its `inputs:` and its dependencies' outputs) ahead, since
either node may free first (`stage_nodes`); `m27 queue` then shows them staged on both,
and the step starts on one of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from m27.client import Client
from m27.client.scheduler import QueueItem
from tests.scheduling_support import agent_system, m27_cli, poll_queue, scheduler_log
from tests.support import Cluster, finished_run, service_log

pytestmark = pytest.mark.integration

#: Holds the whole GPU (busy, so it lends nothing) until the test creates `release`.
HOLD: Final = ("import pathlib, time\n"
               "while not pathlib.Path('release').exists():\n"
               "    end = time.time() + 0.05\n"
               "    while time.time() < end:\n"
               "        pass\n")
HOLDER: Final = ("pipeline:\n  - {name: hold, type: gpu, "
                 "command: '\"$M27_PYTHON\" hold.py'}\n")
#: A second whole-GPU step that reads `data/` (3 files) and the output of its first step.
READER: Final = ("pipeline:\n"
                 "  - {name: make, type: cpu, output: made.txt, "
                 "command: 'echo made > made.txt'}\n"
                 "  - {name: train, type: gpu, depends_on: [make], inputs: [data, absent.bin],"
                 " command: 'cat data/a.bin data/b.bin data/c/d.bin made.txt > /dev/null'}\n")


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1", "node-2")


async def test_a_waiting_step_has_its_inputs_staged_on_the_nodes_it_may_start_on(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "data" / "c").mkdir(parents=True)
    for name, size in (("a.bin", 300_000), ("b.bin", 5_000), ("c/d.bin", 70_000)):
        (work / "data" / name).write_bytes(b"x" * size)
    (work / "hold.py").write_text(HOLD)
    holders = [await client.submit(HOLDER, workdir=str(work)) for _ in range(2)]
    reader = await client.submit(READER, workdir=str(work))
    task = f"{reader}/train"

    def staged(items: list[QueueItem]) -> tuple[str, ...]:
        mine = [i for i in items if i.task_id == task and i.state == "waiting"]
        return mine[0].staged_on if mine and len(mine[0].staged_on) == 2 else ()

    nodes = await poll_queue(system, staged, "not staged on both nodes", timeout=60)
    assert sorted(nodes) == ["node-1", "node-2"], scheduler_log(system)
    # Each agent read the three files and the dependency's output, once; `absent.bin` is
    # missing.
    for node in nodes:
        agent = service_log(system.processes[f"agent-{node}"])
        records = [json.loads(line) for line in agent.splitlines()
                   if '"task.staged"' in line and task in line]
        assert len(records) == 1, agent
        assert records[0]["node_id"] == node  # bound on every line the agent logs
        assert (records[0]["files"], records[0]["bytes"], records[0]["missing"]) == (
            4, 375_005, 1), records[0]
    shown = m27_cli(system, "queue").stdout
    assert f"[ready pool: inputs staged on {', '.join(nodes)}]" in shown, shown

    (work / "release").write_text("")
    for holder in holders:
        assert (await finished_run(client, holder)).state == "succeeded"
    run = await finished_run(client, reader)
    assert run.state == "succeeded", system.logs()
    train = next(s for s in run.steps if s.name == "train")
    assert train.node_id in nodes
    # every line every service logged is JSON with its service named
    for name, process in system.processes.items():
        for line in service_log(process).splitlines():
            assert "service" in json.loads(line), (name, line)
