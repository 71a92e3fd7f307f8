"""A maintenance window's command on this node (`RunMaintenance`): run through /bin/sh in its
own process group, stopped at its time limit, its output's tail kept for the report.

The scheduler sends the command only once the node is empty; the agent checks again and
refuses it while any task of its own still runs (a GPU reset under a running step is
exactly what the window is for avoiding).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Final

from m27.common.events import MaintenanceCommandDone, RunMaintenance

#: What is kept of the command's stdout and stderr together (its end).
OUTPUT_TAIL_BYTES: Final = 4096
#: After SIGTERM at the time limit, how long the group has before SIGKILL.
KILL_AFTER_S: Final = 5.0


def tail_text(data: bytes, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The end of `data` as text (undecodable bytes replaced, NUL removed)."""
    return data[-limit:].decode("utf-8", "replace").replace("\x00", "")


async def _read_tail(stream: asyncio.StreamReader, keep: bytearray) -> None:
    while chunk := await stream.read(65536):
        keep.extend(chunk)
        del keep[:-OUTPUT_TAIL_BYTES]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def run_command(command: RunMaintenance, *, node_id: str, running: int,
                      clock: float) -> MaintenanceCommandDone:
    """Run the window's command (or refuse it while `running` tasks are here)."""
    def done(exit_code: int | None, error: str = "", output: bytes = b"",
             took: float = 0.0) -> MaintenanceCommandDone:
        return MaintenanceCommandDone(at=clock + took, node_id=node_id,
                                      occurrence=command.occurrence, exit_code=exit_code,
                                      output_tail=tail_text(output), duration_s=took,
                                      error=error)

    if running:
        return done(None, f"{running} task(s) still run on the node: not started")
    if not command.command.strip():
        return done(0)
    began = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command.command, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
    except OSError as exc:
        return done(None, f"could not start /bin/sh: {exc}")
    assert process.stdout is not None
    output = bytearray()
    reader = asyncio.create_task(_read_tail(process.stdout, output))
    error = ""
    try:
        await asyncio.wait_for(process.wait(), command.timeout_s)
    except TimeoutError:
        error = f"killed at its time limit ({command.timeout_s:g} s)"
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), KILL_AFTER_S)
        except TimeoutError:
            _signal_group(process.pid, signal.SIGKILL)
            await process.wait()
    # A daemon it started (an MPS control daemon again) may keep the output open: the tail
    # is what arrived by then.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reader, KILL_AFTER_S)
    reader.cancel()
    took = time.monotonic() - began
    code = None if error else process.returncode
    return done(code, error, bytes(output), took)
