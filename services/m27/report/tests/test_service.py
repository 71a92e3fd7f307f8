"""The report shell's handler with a fake bus and a fake API: what it writes, publishes, raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from m27.client import ClientError
from m27.common import events, subjects
from m27.common.bus import PoisonMessage
from m27.common.config import Config, ReportSection
from m27.common.errors import NotFoundError
from m27.common.memory_bus import MemoryBus
from m27.common.model import RunRecord, ServiceInfo, StepRecord
from m27.report.flags import build_parser, overrides
from m27.report.service import (
    NoOrchestrator,
    Reporter,
    RunNotFinished,
    report_dir,
)

RUN = "r-20240501-123456-abcdef"
NOW = 1_714_567_000.0


def services_bus(services: dict[str, ServiceInfo]) -> MemoryBus:
    """An in-memory bus whose services bucket holds these registrations."""
    bus = MemoryBus()
    for key, info in services.items():
        bus.kv[(subjects.SERVICES_BUCKET, key)] = (msgspec.json.encode(info), 1)
    return bus


class FakeApi:
    """GetRun answers from a dict (NOT_FOUND otherwise) or raises `error`."""

    def __init__(self, runs: dict[str, RunRecord], error: Exception | None = None) -> None:
        self.runs = runs
        self.error = error
        self.calls: list[tuple[str, str]] = []
        self.bound: list[dict[str, Any]] = []

    async def __call__(self, address: str, run_id: str) -> RunRecord:
        self.calls.append((address, run_id))
        self.bound.append(structlog.contextvars.get_contextvars())
        if self.error is not None:
            raise self.error
        if run_id not in self.runs:
            raise NotFoundError(f"no run {run_id}")
        return self.runs[run_id]


def a_run(state: str = "failed") -> RunRecord:
    step = StepRecord(name="train", type="gpu", command="python train.py", state="failed",
                      exit_code=1, started_at=NOW - 60, ended_at=NOW - 1)
    return RunRecord(run_id=RUN, name="sweep", user="alice", urgency="normal",
                     state=state, created_at=NOW - 100, steps=(step,))  # type: ignore[arg-type]


def msg(event: events.Message) -> Msg:
    return Msg(_client=cast(NatsClient, None), subject=subjects.run_state(RUN),
               data=events.encode(event))


def finished(state: str = "failed") -> Msg:
    return msg(events.RunStateChanged(at=NOW, run_id=RUN, state=state,  # type: ignore[arg-type]
                                      previous="running"))


def reporter(tmp_path: Path, api: FakeApi, nats: MemoryBus | None = None,
             address: str = "127.0.0.1:5000") -> tuple[Reporter, MemoryBus]:
    fake_bus = nats or MemoryBus()
    return Reporter(fake_bus, tmp_path, api=address, fetch=api, clock=lambda: NOW), fake_bus


async def test_a_finished_run_gets_a_report_and_an_announcement(tmp_path: Path) -> None:
    api = FakeApi({RUN: a_run()})
    handler, nats = reporter(tmp_path, api)
    await handler.handle(finished())
    path = tmp_path / f"{RUN}.html"
    assert "python train.py" in path.read_text()
    assert api.calls == [("127.0.0.1:5000", RUN)]
    assert nats.published == [(subjects.run_report(RUN),
                               events.ReportReady(at=NOW, run_id=RUN, path=str(path)),
                               f"{RUN}:report")]


async def test_the_run_id_is_bound_while_handling(tmp_path: Path) -> None:
    api = FakeApi({RUN: a_run()})
    handler, _ = reporter(tmp_path, api)
    await handler.handle(finished())
    assert api.bound[0].get("run_id") == RUN
    assert "run_id" not in structlog.contextvars.get_contextvars()


@pytest.mark.parametrize("event", [
    events.RunStateChanged(at=NOW, run_id=RUN, state="running", previous="queued"),
    events.RunSubmitted(at=NOW, run_id=RUN, name="n", user="u", urgency="normal", steps=()),
])
async def test_other_events_are_acked_without_a_report(tmp_path: Path,
                                                       event: events.Message) -> None:
    api = FakeApi({RUN: a_run()})
    handler, nats = reporter(tmp_path, api)
    await handler.handle(msg(event))
    assert api.calls == []
    assert nats.published == []
    assert listing(tmp_path) == []


async def test_an_unknown_run_is_logged_and_acked(tmp_path: Path) -> None:
    handler, nats = reporter(tmp_path, FakeApi({}))
    with capture_logs() as logs:
        await handler.handle(finished())  # returns: the consumer acks
    assert [entry["event"] for entry in logs] == ["report.run_not_found"]
    assert nats.published == []
    assert listing(tmp_path) == []


@pytest.mark.parametrize("error", [
    ClientError("cannot reach the m27 API at 127.0.0.1:5000: is it up?"),
    ClientError("internal: boom"),
])
async def test_an_api_failure_raises_so_the_event_is_redelivered(tmp_path: Path,
                                                                 error: Exception) -> None:
    handler, nats = reporter(tmp_path, FakeApi({}, error=error))
    with pytest.raises(ClientError):
        await handler.handle(finished())
    assert nats.published == []
    assert listing(tmp_path) == []


async def test_a_run_the_api_shows_unfinished_is_retried(tmp_path: Path) -> None:
    handler, nats = reporter(tmp_path, FakeApi({RUN: a_run(state="running")}))
    with pytest.raises(RunNotFinished):
        await handler.handle(finished())
    assert nats.published == []


async def test_an_undecodable_message_is_poison(tmp_path: Path) -> None:
    handler, _ = reporter(tmp_path, FakeApi({}))
    bad = Msg(_client=cast(NatsClient, None), subject="x", data=b'{"type":"nonsense"}')
    with pytest.raises(PoisonMessage):
        await handler.handle(bad)


def listing(directory: Path) -> list[str]:
    """The directory's entries (sync: the async tests call it between awaits)."""
    return sorted(p.name for p in directory.iterdir())


def registered(address: str, started_at: float) -> ServiceInfo:
    return ServiceInfo(name="orchestrator", instance="i", grpc_address=address, pid=1,
                       host="h", started_at=started_at)


async def test_without_api_the_newest_registered_orchestrator_is_asked(tmp_path: Path) -> None:
    api = FakeApi({RUN: a_run()})
    nats = services_bus({"orchestrator.old": registered("127.0.0.1:1", 1.0),
                         "orchestrator.new": registered("127.0.0.1:2", 2.0),
                         "scheduler.h": registered("127.0.0.1:3", 3.0)})
    handler, _ = reporter(tmp_path, api, nats, address="")
    await handler.handle(finished())
    assert api.calls == [("127.0.0.1:2", RUN)]


async def test_without_any_orchestrator_the_event_is_retried(tmp_path: Path) -> None:
    api = FakeApi({RUN: a_run()})
    handler, _ = reporter(tmp_path, api, MemoryBus(), address="")
    with pytest.raises(NoOrchestrator):
        await handler.handle(finished())
    assert api.calls == []


@pytest.mark.parametrize(("argv", "expected"), [
    ([], None),
    (["--out", "/srv/reports"], "/srv/reports"),
])
def test_out_flag_maps_to_the_report_dir_key(argv: list[str], expected: str | None) -> None:
    args = build_parser().parse_args(["--nats", "nats://x:4222", *argv])
    assert overrides(args) == {("report", "dir"): expected}


def test_api_flag() -> None:
    assert build_parser().parse_args(["--api", "h:1"]).api == "h:1"
    assert build_parser().parse_args([]).api == ""


def test_report_dir_defaults_under_m27_home(tmp_path: Path) -> None:
    assert report_dir(Config(), tmp_path) == tmp_path / "reports"


def test_report_dir_from_config_is_absolute(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    configured = Config(report=ReportSection(dir="out"))
    assert report_dir(configured, tmp_path / "home") == tmp_path / "out"
