"""Two copies of a service on one bus (a rolling update, a mistake). Schedulers: one acts,
the other waits; when the active one dies the standby takes over and work goes on, each
step run once. Orchestrators: both act. Reports: each is a whole replica."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from m27.client import Client
from m27.common import subjects
from m27.common.bus import NatsBus
from m27.common.grpc_server import LIVE_SERVICE
from m27.common.model import ServiceInfo
from m27.embedded.processes import wait_ready
from m27.report.service import RUN_STATES, history_path
from m27.report.store import History
from tests.support import Cluster, finished_run, service_log, wait_for

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

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


async def _runs_once(system: Cluster, client: Client, workdir: Path) -> None:
    """PIPELINE runs to success, each step once."""
    run = await finished_run(client, await client.submit(PIPELINE, workdir=str(workdir)))
    assert run.state == "succeeded", system.logs()
    assert [s.attempt for s in run.steps] == [1, 1, 1]


async def test_a_second_scheduler_waits_and_takes_over_when_the_first_dies(
        tmp_path: Path) -> None:
    system = Cluster(tmp_path, env={"M27_SCHEDULER_LEASE": "2s"})
    system.start()
    try:
        standby = system.launch("scheduler-2", "m27.scheduler", ["--instance", "standby"])
        await wait_for(lambda: "leader.standby" in service_log(standby), "a standby",
                       timeout=30)
        async with system.client() as client:
            await _runs_once(system, client, tmp_path)
            assert "leader.elected" not in service_log(standby)
            os.kill(system.processes["scheduler"].pid, signal.SIGKILL)
            await wait_for(lambda: "leader.elected" in service_log(standby),
                           "the standby takes over", timeout=30)
            await _runs_once(system, client, tmp_path)
    finally:
        system.stop()


async def _health(system: Cluster, address: str, service: str) -> int:
    async with system.bare_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


async def test_a_deposed_scheduler_stops_acting_and_is_no_longer_ready(
        tmp_path: Path) -> None:
    """The active copy frozen past its lease (SIGSTOP) is replaced; woken, it finds its
    lease taken, steps down, and says so: not ready (a Service sends it nothing), alive,
    its registration withdrawn (clients find the new active one)."""
    system = Cluster(tmp_path, env={"M27_SCHEDULER_LEASE": "2s"})
    system.start()
    try:
        first = system.processes["scheduler"]
        standby = system.launch("scheduler-2", "m27.scheduler", ["--instance", "standby"])
        await wait_for(lambda: "leader.standby" in service_log(standby), "a standby",
                       timeout=30)
        assert await _health(system, first.grpc_address, "") == SERVING
        os.kill(first.pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: "leader.elected" in service_log(standby),
                           "the standby takes over", timeout=30)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        await wait_for(lambda: "service.unready" in service_log(first),
                       "the deposed copy steps down", timeout=30)
        assert await _health(system, first.grpc_address, "") == NOT_SERVING
        assert await _health(system, first.grpc_address, LIVE_SERVICE) == SERVING
        bus = await NatsBus.open(system.nats_url, name="test")
        try:  # a deleted key is listed with its tombstone: kv_get says None
            keys = [key for key in await bus.kv_keys(subjects.SERVICES_BUCKET, "scheduler.*")
                    if await bus.kv_get(subjects.SERVICES_BUCKET, key, ServiceInfo)]
        finally:
            await bus.close()
        assert keys == [subjects.service_key("scheduler", "standby")], keys
        async with system.client() as client:  # and work goes on through the new one
            await _runs_once(system, client, tmp_path)
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


LOGS_METRICS = """\
pipeline:
  - name: m
    command: |
      echo '{"step": 1, "loss": 0.9}' >> "$M27_METRICS_FILE"
      echo '{"step": 2, "loss": 0.5}' >> "$M27_METRICS_FILE"
"""


def _holds(home: Path, run_id: str) -> bool:
    """That copy's history has the run's loss curve and its report file is written."""
    history = History(history_path(home))
    try:
        points = history.metric_series(run_id, "m", "loss")
    finally:
        history.close()
    return len(points) == 2 and (home / "reports" / f"{run_id}.html").exists()


def _position(home: Path) -> int:
    history = History(history_path(home))
    try:
        return history.position(RUN_STATES.name)
    finally:
        history.close()


async def test_two_reports_each_hold_everything_and_either_may_die(tmp_path: Path) -> None:
    """Every report copy reads each stream itself from its own position (report.replica):
    a second copy with a home of its own (as a pod of its own) holds every run's metrics
    and writes every report; with the first killed it goes on alone; the first, started
    again, reads on from where its store was, not from the start."""
    system = Cluster(tmp_path)
    system.start()
    try:
        home2 = tmp_path / "home2"
        second = system.launch("report-2", "m27.report", ["--instance", "r2"],
                               env={"M27_HOME": str(home2)})
        wait_ready([second])
        async with system.client() as client:
            before = await finished_run(client, await client.submit(
                LOGS_METRICS, workdir=str(tmp_path)))
            assert before.state == "succeeded", system.logs()
            for home in (system.home, home2):
                await wait_for(lambda home=home: _holds(home, before.run_id),  # type: ignore[misc]
                               f"{home}: the first run's metrics and report", timeout=30)
            bus = await NatsBus.open(system.nats_url, name="test")
            try:  # the run's end is read and its position stored (after the report file)
                ended = (await bus.js.get_last_msg(subjects.EVENTS_STREAM,
                                                   subjects.run_state(before.run_id))).seq
            finally:
                await bus.close()
            await wait_for(lambda: _position(system.home) > (ended or 0),
                           "the first copy stored its position", timeout=30)
            os.kill(system.processes["report"].pid, signal.SIGKILL)
            alone = await finished_run(client, await client.submit(
                LOGS_METRICS, workdir=str(tmp_path)))
            assert alone.state == "succeeded", system.logs()
            await wait_for(lambda: _holds(home2, alone.run_id), "the survivor's report",
                           timeout=30)

            async def announced() -> bool:
                return bool((await client.get_run(alone.run_id)).report_path)

            deadline = time.monotonic() + 30
            while not await announced():
                assert time.monotonic() < deadline, system.logs()
                await asyncio.sleep(0.1)
            assert not (system.home / "reports" / f"{alone.run_id}.html").exists()
            again = system.launch("report-again", "m27.report")
            wait_ready([again])
            await wait_for(lambda: _holds(system.home, alone.run_id),
                           "the restarted copy catches up", timeout=30)

            def written() -> list[str]:
                return [line for line in service_log(again).splitlines()
                        if "report.written" in line]

            # the file is written before its log line: wait for the line, not the file
            await wait_for(lambda: bool(written()), "the restarted copy logs its report",
                           timeout=30)
            assert [alone.run_id in line for line in written()] == [True], written()
    finally:
        system.stop()
