"""The report service against the real orchestrator: it waits out an unreachable API and
never retries a run that does not exist; two copies each hold everything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.embedded.processes import stop, wait_ready
from m27.report.service import RUN_STATES, history_path
from m27.report.store import History
from tests.support import Cluster, service_log

pytestmark = pytest.mark.integration


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.start()
    yield cluster
    cluster.stop()


async def wait_until(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def test_a_report_is_written_once_the_api_is_back(system: Cluster) -> None:
    stop([system.processes.pop("report")])
    async with system.client() as client:
        run_id = await client.submit("pipeline:\n  - {name: only, command: 'echo done'}\n")

        async def finished() -> bool:
            return (await client.get_run(run_id)).state == "succeeded"

        await wait_until(finished)
    stop([system.processes.pop("orchestrator")])
    report = system.launch("report", "m27.report")
    wait_ready([report])

    async def tried() -> bool:  # it saw the finished run and could not reach the API
        return '"source": "run-states"' in service_log(report) and (
            "bus.handler_failed" in service_log(report))

    await wait_until(tried)
    assert not (system.home / "reports" / f"{run_id}.html").exists()
    orchestrator = system.launch("orchestrator", "m27.orchestrator")
    wait_ready([orchestrator])
    async with system.client() as client:

        async def reported() -> bool:
            return bool((await client.get_run(run_id)).report_path)

        await wait_until(reported)
        path = Path((await client.get_run(run_id)).report_path)
    assert path == system.home / "reports" / f"{run_id}.html"
    assert "only" in path.read_text()


async def test_an_unknown_run_is_acknowledged_not_retried(system: Cluster) -> None:
    bus = await NatsBus.open(system.nats_url, name="test")
    ghost = "r-20000101-000000-0000aa"
    ack = await bus.js.publish(subjects.run_state(ghost), events.encode(events.RunStateChanged(
        at=time.time(), run_id=ghost, state="failed", previous="running")))
    log_of = system.processes["report"]

    async def logged() -> bool:
        return "report.run_not_found" in service_log(log_of)

    await wait_until(logged)

    await bus.close()
    history = History(history_path(system.home))

    async def passed() -> bool:  # its position is stored: this copy never reads it again
        return history.position(RUN_STATES.name) > ack.seq

    try:
        await wait_until(passed)
    finally:
        history.close()
    assert service_log(log_of).count("report.run_not_found") == 1
    assert not (system.home / "reports" / f"{ghost}.html").exists()
