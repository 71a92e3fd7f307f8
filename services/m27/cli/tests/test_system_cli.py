"""What `m27 demo` says it leaves running (pure)."""

from __future__ import annotations

from m27.cli._system import closing_note
from m27.embedded.processes import ServiceProcess
from m27.embedded.system import EmbeddedState


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
