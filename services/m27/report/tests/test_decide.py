"""Which events get a report, where it goes, and which orchestrator is asked for the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from m27.common import events
from m27.common.model import ServiceInfo
from m27.report import ReportDecision, decide, pick_orchestrator, report_file

RUN = "r-20240501-123456-abcdef"


def changed(state: str, run_id: str = RUN) -> events.RunStateChanged:
    return events.RunStateChanged(at=1.0, run_id=run_id, state=state,  # type: ignore[arg-type]
                                  previous="running")


@pytest.mark.parametrize(("event", "write", "reason"), [
    (changed("succeeded"), True, "run succeeded"),
    (changed("failed"), True, "run failed"),
    (changed("cancelled"), True, "run cancelled"),
    (changed("running"), False, "run is running, not finished"),
    (changed("queued"), False, "run is queued, not finished"),
    (events.RunSubmitted(at=1.0, run_id=RUN, name="n", user="u", urgency="normal", steps=()),
     False, "run_submitted is not a run state change"),
    (events.ReportReady(at=1.0, run_id=RUN, path="/x.html"), False,
     "report_ready is not a run state change"),
    (events.NodeLost(at=1.0, node_id="n1", last_heartbeat=0.0), False,
     "node_lost is not a run state change"),
    (changed("failed", run_id="../../etc/passwd"), False,
     "run id is not usable as a file name"),
    (changed("failed", run_id=""), False, "run id is not usable as a file name"),
])
def test_decide(event: events.Event, write: bool, reason: str) -> None:
    decision = decide(event)
    assert decision.write is write
    assert decision.reason == reason


def test_decide_names_the_run() -> None:
    assert decide(changed("failed")) == ReportDecision(write=True, run_id=RUN,
                                                       reason="run failed")


def test_report_file_is_named_after_the_run(tmp_path: Path) -> None:
    assert report_file(tmp_path, RUN) == tmp_path / f"{RUN}.html"


@pytest.mark.parametrize("run_id", ["../x", "a/b", "", ".hidden", "a b"])
def test_report_file_refuses_ids_that_leave_the_directory(tmp_path: Path, run_id: str) -> None:
    with pytest.raises(ValueError, match="not a safe run id"):
        report_file(tmp_path, run_id)


def info(name: str, address: str, started_at: float) -> ServiceInfo:
    return ServiceInfo(name=name, instance="i", grpc_address=address, pid=1, host="h",
                       started_at=started_at)


@pytest.mark.parametrize(("entries", "expected"), [
    ([], None),
    ([("scheduler.h", info("scheduler", "127.0.0.1:1", 5.0))], None),
    ([("orchestrator.h", info("orchestrator", "127.0.0.1:2", 5.0))], "127.0.0.1:2"),
    ([("orchestrator.old", info("orchestrator", "127.0.0.1:3", 1.0)),
      ("orchestrator.new", info("orchestrator", "127.0.0.1:4", 9.0)),
      ("scheduler.h", info("scheduler", "127.0.0.1:1", 99.0))], "127.0.0.1:4"),
    ([("orchestrator.b", info("orchestrator", "127.0.0.1:6", 5.0)),
      ("orchestrator.a", info("orchestrator", "127.0.0.1:5", 5.0))], "127.0.0.1:5"),
    ([("orchestrator.h", info("orchestrator", "", 9.0))], None),
    ([("orchestrators.h", info("orchestrator", "127.0.0.1:7", 9.0))], None),
])
def test_pick_orchestrator(entries: list[tuple[str, ServiceInfo]],
                           expected: str | None) -> None:
    """The newest registered orchestrator with an address; ties broken by key."""
    assert pick_orchestrator(entries) == expected
