"""A maintenance window's command on the node: run through /bin/sh, its output's tail kept,
stopped at its time limit with whatever it started, refused while tasks run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from m27.common.events import RunMaintenance
from m27.node_agent._maintenance import OUTPUT_TAIL_BYTES, run_command, tail_text


def command(text: str, timeout_s: float = 30.0) -> RunMaintenance:
    return RunMaintenance(at=0.0, node_id="n1", occurrence=1000.0, command=text,
                          timeout_s=timeout_s)


async def test_the_command_runs_and_its_exit_and_output_tail_are_reported(
        tmp_path: Path) -> None:
    marker = tmp_path / "reset"
    done = await run_command(command(f"echo resetting; touch {marker}; exit 3"),
                             node_id="n1", running=0, clock=50.0)
    assert marker.exists()
    assert (done.exit_code, done.error, done.occurrence) == (3, "", 1000.0)
    assert done.output_tail == "resetting\n"
    assert done.at >= 50.0


async def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    began = time.monotonic()
    done = await run_command(command(f"sleep 60 & echo $! > {pids}; wait", timeout_s=0.5),
                             node_id="n1", running=0, clock=0.0)
    assert done.exit_code is None
    assert "time limit" in done.error
    assert time.monotonic() - began < 15
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the command's child outlived its time limit"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    """Running (a killed child not yet reaped by init is a zombie: not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


async def test_refused_while_tasks_run_and_nothing_to_run_succeeds() -> None:
    refused = await run_command(command("touch /never"), node_id="n1", running=2, clock=0.0)
    assert refused.exit_code is None
    assert "2 task(s) still run" in refused.error
    assert (await run_command(command("  "), node_id="n1", running=0, clock=0.0)).exit_code == 0


def test_the_tail_is_the_end_and_text() -> None:
    data = b"x" * 10_000 + b"\x00end\xff"
    text = tail_text(data)
    assert text.endswith("end\ufffd")
    assert "\x00" not in text
    assert len(text) <= OUTPUT_TAIL_BYTES
