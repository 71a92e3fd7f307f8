"""Runs survive their orchestrator and scheduler being killed (SIGKILL) mid-run: the run
continues when they come back, no step runs twice, none is forgotten."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import wait_ready
from tests.support import Cluster

pytestmark = pytest.mark.integration

PIPELINE = """pipeline:
  - {name: a, command: "echo a >> ran.log; sleep 0.5"}
  - {name: b, command: "echo b >> ran.log; sleep 2", depends_on: [a]}
  - {name: c, command: "echo c >> ran.log", depends_on: [b]}
  - {name: d, command: "echo d >> ran.log; sleep 1", depends_on: [a]}
  - name: sweep
    depends_on: [a]
    matrix: {i: [1, 2, 3, 4, 5, 6]}
    max_parallel: 2
    command: "echo sweep{{matrix.i}} >> ran.log; sleep 0.3"
  - {name: e, command: "echo e >> ran.log", depends_on: [c, d, sweep]}
"""


def kill(cluster: Cluster, name: str) -> None:
    proc = cluster.processes.pop(name)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, 0)


def restart(cluster: Cluster, name: str, module: str) -> None:
    wait_ready([cluster.launch(name, module)])


async def state_of(cluster: Cluster, run_id: str, step: str) -> str:
    async with cluster.client() as client:
        found = (await client.get_run(run_id)).step(step)
        return found.state if found else "?"


async def test_killing_orchestrator_and_scheduler_mid_run_loses_and_repeats_nothing(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "system")
    cluster.start()
    work = tmp_path / "work"
    work.mkdir()
    try:
        async with cluster.client() as client:
            run_id = await client.submit(PIPELINE, workdir=str(work))
        deadline = time.monotonic() + 30
        while await state_of(cluster, run_id, "b") != "running":
            assert time.monotonic() < deadline, cluster.logs()
            await asyncio.sleep(0.05)
        kill(cluster, "orchestrator")
        kill(cluster, "scheduler")
        killed_at = time.monotonic()
        await asyncio.sleep(2.5)  # b and d finish while nobody is listening
        restart(cluster, "orchestrator", "m27.orchestrator")
        await asyncio.sleep(0.3)
        kill(cluster, "orchestrator")  # and once more, right after coming back
        restart(cluster, "scheduler", "m27.scheduler")
        restart(cluster, "orchestrator", "m27.orchestrator")
        async with cluster.client() as client:
            deadline = time.monotonic() + 60
            while (run := await client.get_run(run_id)).state not in {"succeeded", "failed"}:
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.1)
        assert run.state == "succeeded", cluster.logs()
        # Messages the killed services had fetched come back after the ack wait (5 s), not
        # after the 30 s default: a crash costs seconds.
        assert time.monotonic() - killed_at < 25
        ran = Counter((work / "ran.log").read_text().split())
        expected = ["a", "b", "c", "d", "e"] + [f"sweep{i}" for i in range(1, 7)]
        assert ran == Counter(expected), ran
        assert all(s.attempt == 1 for s in run.steps)
    finally:
        cluster.stop()
