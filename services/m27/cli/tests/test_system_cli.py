"""What `m27 demo` says it leaves running, and how `m27 status` shows each process and its
supervision (pure, or on this very process's pid)."""

from __future__ import annotations

import json
import os
import time

import msgspec

from m27.cli._system import closing_note, revived_note, status_line, supervision_note
from m27.embedded.processes import ServiceProcess
from m27.embedded.state import Supervision
from m27.embedded.system import EmbeddedState, ProcessStatus, is_up, status_json, statuses


def state() -> EmbeddedState:
    processes = [ServiceProcess(name=name, module=f"m27.{name}", pid=100 + i, log_path="",
                                ready_file="")
                 for i, name in enumerate(("orchestrator", "scheduler", "node-agent-1"))]
    return EmbeddedState(home="/h", nats_url="nats://127.0.0.1:1", nats_pid=99, api="a",
                         processes=processes, started_at=0.0, gpus="sim:2",
                         simulated_gpus=True)


def test_the_demo_says_what_still_runs_and_how_to_stop_it() -> None:
    note = closing_note(state(), started=True, stopped=False)
    assert "still running under /h (the demo started it)" in note
    assert "nats-server, orchestrator, scheduler, node-agent-1" in note
    assert "`m27 down` stops it" in note
    assert "`m27 demo --down`" in note
    before = closing_note(state(), started=False, stopped=False)
    assert "it was running before the demo" in before
    assert "--down" not in before
    assert closing_note(state(), started=True, stopped=True) == (
        "m27: stopped the system the demo started (--down)")


def row(**fields: object) -> ProcessStatus:
    base: dict[str, object] = {"name": "scheduler", "pid": 4321, "alive": True,
                               "grpc_address": "127.0.0.1:5001",
                               "log_path": "/h/logs/scheduler.log"}
    return msgspec.convert({**base, **fields}, ProcessStatus)


AT = time.mktime((2026, 12, 5, 14, 2, 11, 0, 0, -1))  # 14:02:11 local time


def test_status_shows_restarts_and_the_last_exit_of_a_process() -> None:
    assert status_line(row(), AT) == "  up   scheduler          pid 4321     127.0.0.1:5001"
    restarted = row(restarts=1, last_exit="SIGKILL", last_exit_at=AT)
    assert status_line(restarted, AT).endswith(
        "127.0.0.1:5001  restarts 1, last exit: SIGKILL at 14:02:11")
    waiting = row(alive=False, state="restarting", restarts=2, last_exit="exit code 1",
                  last_exit_at=AT, restart_at=AT + 4)
    assert status_line(waiting, AT).startswith("  DOWN scheduler")
    assert supervision_note(waiting, AT) == (
        "restarting in 4s (restarts 2, last exit: exit code 1 at 14:02:11)")
    starting = row(state="starting", restarts=1, last_exit="SIGKILL", last_exit_at=AT)
    assert supervision_note(starting, AT).startswith("starting again (restarts 1")


def test_status_flags_a_crash_looping_process_with_why_and_its_log() -> None:
    gave_up = row(alive=False, state="gave-up", crash_looping=True, restarts=4,
                  last_exit="exit code 2", last_exit_at=AT,
                  reason="gave up after 5 exits within 10m")
    assert supervision_note(gave_up, AT) == (
        "CRASH-LOOPING: gave up after 5 exits within 10m; last exit: exit code 2 at "
        "14:02:11; its log /h/logs/scheduler.log")
    assert "dead, and nothing restarts it" in status_line(row(alive=False, state="dead"), AT)


def test_up_says_what_it_started_again() -> None:
    assert revived_note(["scheduler"]) == "started scheduler again"
    assert revived_note(["nats-server-2"]) == (
        "started nats-server-2 again: a NATS server rejoins the cluster and catches up from "
        "the others")


def test_without_its_supervisor_a_dead_process_is_dead_and_the_system_not_up() -> None:
    alive = state()
    alive.processes = [msgspec.structs.replace(p, pid=os.getpid()) for p in alive.processes]
    alive.nats_pid = os.getpid()
    alive.supervision = {"scheduler": Supervision(state="restarting", restarts=1,
                                                  last_exit="SIGKILL", last_exit_at=AT)}
    alive.supervisor_pid = os.getpid()
    rows = {r.name: r for r in statuses(alive)}
    assert (rows["scheduler"].state, rows["scheduler"].restarts) == ("restarting", 1)
    assert not is_up(alive)  # one waits for its restart
    alive.supervision = {}
    assert is_up(alive)
    orphaned = msgspec.structs.replace(alive, supervisor_pid=2**22 + 12345)
    orphaned.processes[0] = msgspec.structs.replace(orphaned.processes[0], pid=2**22 + 12346)
    rows = {r.name: r for r in statuses(orphaned)}
    assert rows["orchestrator"].state == "dead"
    assert rows["scheduler"].state == "running"
    assert not is_up(orphaned)  # nothing would restart what exits
    assert json.loads(status_json(orphaned))["supervisor"] == {"pid": 2**22 + 12345,
                                                              "alive": False}
