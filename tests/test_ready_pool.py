"""The ready pool end to end, with a real node-agent on one simulated GPU: while a
whole-GPU step holds the GPU, the next whole-GPU step waits, and the scheduler has the
agent read its inputs (its `inputs:` and its dependencies' outputs) ahead on the node it
will start on; `m27 queue` then shows them staged there, and the step starts there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from m27.client import Client
from tests.scheduling_support import agent_system, m27_cli, queue, scheduler_log
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
    yield from agent_system(tmp_path, "node-1")


async def test_a_waiting_step_has_its_inputs_staged_on_the_node_it_then_starts_on(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "data" / "c").mkdir(parents=True)
    for name, size in (("a.bin", 300_000), ("b.bin", 5_000), ("c/d.bin", 70_000)):
        (work / "data" / name).write_bytes(b"x" * size)
    (work / "hold.py").write_text(HOLD)
    holder = await client.submit(HOLDER, workdir=str(work))
    reader = await client.submit(READER, workdir=str(work))
    task = f"{reader}/train"

    async def staged() -> str:
        items = [i for i in await queue(system) if i.task_id == task]
        return items[0].staged_on if items and items[0].state == "waiting" else ""

    node, deadline = "", time.monotonic() + 60
    while not node and time.monotonic() < deadline:
        node = await staged()
        await asyncio.sleep(0.2)
    assert node == "node-1", scheduler_log(system)
    # The agent read the three files and the dependency's output; `absent.bin` is missing.
    agent = service_log(system.processes["agent-node-1"])
    records = [json.loads(line) for line in agent.splitlines()
               if '"task.staged"' in line and task in line]
    assert records, agent
    assert (records[-1]["files"], records[-1]["bytes"], records[-1]["missing"]) == (
        4, 375_005, 1), records[-1]
    shown = m27_cli(system, "queue").stdout
    assert "[ready pool: inputs staged on node-1]" in shown, shown

    (work / "release").write_text("")
    assert (await finished_run(client, holder)).state == "succeeded"
    run = await finished_run(client, reader)
    assert run.state == "succeeded", system.logs()
    train = next(s for s in run.steps if s.name == "train")
    assert train.node_id == "node-1"
