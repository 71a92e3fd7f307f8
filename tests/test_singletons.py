"""Two schedulers on one bus (a rolling update, a mistake): one acts, the other waits; when
the active one dies the standby takes over and work goes on, each step run once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from m27.client import Client
from m27.embedded.processes import wait_ready
from tests.support import Cluster, finished_run, service_log, wait_for

pytestmark = pytest.mark.integration

PIPELINE = """\
pipeline:
  - name: a
    command: echo a
  - name: b
    command: echo b
    depends_on: [a]
  - name: c
    command: echo c
    depends_on: [a]
"""


async def test_a_second_scheduler_waits_and_takes_over_when_the_first_dies(
        tmp_path: Path) -> None:
    system = Cluster(tmp_path, env={"M27_SCHEDULER_LEASE": "2s"})
    system.start()
    try:
        standby = system.launch("scheduler-2", "m27.scheduler", ["--instance", "standby"])
        await wait_for(lambda: "leader.standby" in service_log(standby), "a standby",
                       timeout=30)
        async with system.client() as client:
            run = await finished_run(client, await client.submit(PIPELINE,
                                                                 workdir=str(tmp_path)))
            assert run.state == "succeeded", system.logs()
            assert [s.attempt for s in run.steps] == [1, 1, 1]
            assert "leader.elected" not in service_log(standby)
            os.kill(system.processes["scheduler"].pid, signal.SIGKILL)
            await wait_for(lambda: "leader.elected" in service_log(standby),
                           "the standby takes over", timeout=30)
            run = await finished_run(client, await client.submit(PIPELINE,
                                                                 workdir=str(tmp_path)))
            assert run.state == "succeeded", system.logs()
            assert [s.attempt for s in run.steps] == [1, 1, 1]
    finally:
        system.stop()


SLOW = """\
pipeline:
  - name: a
    command: sleep 2
  - name: b
    command: echo b
    depends_on: [a]
"""


async def test_two_orchestrators_both_serve_and_either_may_die(tmp_path: Path) -> None:
    """The orchestrator is safe with several active copies by design (every change a
    compare-and-set on the run, its messages sent from an outbox with stable ids): runs
    submitted through either finish when one is killed mid-run, each step once."""
    system = Cluster(tmp_path)
    system.start()
    try:
        second = system.launch("orchestrator-2", "m27.orchestrator", ["--instance", "o2"])
        wait_ready([second])
        first = system.processes["orchestrator"]
        runs = []
        for proc in (first, second, first, second):
            async with Client(proc.grpc_address, access=system.access) as client:
                runs.append(await client.submit(SLOW, workdir=str(tmp_path)))
        os.kill(first.pid, signal.SIGKILL)
        async with Client(second.grpc_address, access=system.access) as client:
            for run_id in runs:
                run = await finished_run(client, run_id, timeout=120)
                assert run.state == "succeeded", system.logs()
                assert [s.attempt for s in run.steps] == [1, 1], run
    finally:
        system.stop()
