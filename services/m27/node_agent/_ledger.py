"""The agent's memory across restarts: which task attempts it has seen and which still run.

Steps run in their own sessions, so they outlive an agent that crashes. The next agent on
the node reads this file, kills what is left of those steps and reports them exited, and
does not run a redelivered StartTask a second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec

from m27.common import subjects
from m27.common.bus import Bus
from m27.common.events import TaskExited
from m27.common.logging import get_logger
from m27.node_agent._process import find_task_processes, kill_pids, read_tail
from m27.node_agent._tasks import STDERR_TAIL_BYTES, STDOUT_TAIL_BYTES

log = get_logger()

#: How many task ids the agent remembers; older ones can no longer be redelivered anyway.
MAX_SEEN: Final = 10_000
ORPHAN_KILLED_EXIT_CODE: Final = 128 + 9


class LedgerTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task that was running when the ledger was written."""

    task_id: str
    run_id: str
    step: str
    attempt: int
    pid: int
    started_at: float
    stdout_path: str = ""
    stderr_path: str = ""


class LedgerState(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    seen: dict[str, int] = msgspec.field(default_factory=dict)
    running: tuple[LedgerTask, ...] = ()


def ledger_path(home: Path, node_id: str) -> Path:
    return home / "nodes" / node_id / "agent-state.json"


def remember(seen: dict[str, int], task_id: str, attempt: int) -> None:
    """Record an attempt, keeping the newest `MAX_SEEN` task ids (insertion order = age)."""
    seen.pop(task_id, None)
    seen[task_id] = attempt
    while len(seen) > MAX_SEEN:
        del seen[next(iter(seen))]


def load(path: Path, node_id: str) -> LedgerState:
    """The saved state, or an empty one when there is none or it cannot be read."""
    try:
        state = msgspec.json.decode(path.read_bytes(), type=LedgerState)
    except FileNotFoundError:
        return LedgerState(node_id=node_id)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("ledger.unreadable", path=str(path), error=str(exc))
        return LedgerState(node_id=node_id)
    if state.node_id != node_id:
        log.warning("ledger.other_node", path=str(path), node_in_file=state.node_id)
        return LedgerState(node_id=node_id)
    return state


def save(path: Path, state: LedgerState) -> None:
    """Write, fsync, rename: after a crash the file is the old or the new state, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as file:
            file.write(msgspec.json.encode(state))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("ledger.write_failed", path=str(path), error=str(exc))
        with contextlib.suppress(OSError):
            tmp.unlink()


def orphan_exit(entry: LedgerTask, node_id: str, killed: int, now: float, *,
                stdout_tail: str = "", stderr_tail: str = "") -> TaskExited:
    """How a task that ran under an earlier agent ended, as well as the new agent can tell.

    Its exit status died with the earlier agent: if processes were left they were killed
    (reported as SIGKILL), otherwise the status is unknown (exit_code None).
    """
    exit_code: int | None
    if killed:
        exit_code, signal = ORPHAN_KILLED_EXIT_CODE, 9
        reason = (f"killed by SIGKILL: the node agent restarted while the task ran "
                  f"({killed} leftover process(es) killed)")
    else:
        exit_code, signal = None, None
        reason = "exit status unknown: the task ended while the node agent was down"
    return TaskExited(
        at=now, task_id=entry.task_id, run_id=entry.run_id, step=entry.step,
        attempt=entry.attempt, node_id=node_id, exit_code=exit_code, signal=signal,
        started=True, started_at=entry.started_at, stdout_path=entry.stdout_path,
        stderr_path=entry.stderr_path, stdout_tail=stdout_tail, stderr_tail=stderr_tail,
        reason=reason, cause="agent_restarted",
    )


class Ledger:
    """The file for one node, and the attempts seen, as the runner uses them."""

    def __init__(self, home: Path, node_id: str) -> None:
        self.path = ledger_path(home, node_id)
        self.node_id = node_id
        self.seen: dict[str, int] = {}

    def latest(self, task_id: str) -> int | None:
        """The newest attempt of `task_id` this node has seen, if any."""
        return self.seen.get(task_id)

    def remember(self, task_id: str, attempt: int) -> None:
        remember(self.seen, task_id, attempt)

    def save(self, running: Iterable[LedgerTask]) -> None:
        save(self.path, LedgerState(node_id=self.node_id, seen=self.seen,
                                    running=tuple(running)))

    def load(self) -> tuple[LedgerTask, ...]:
        """Read the file: the attempts seen become this ledger's; returns the tasks that an
        earlier agent left running."""
        state = load(self.path, self.node_id)
        self.seen = dict(state.seen)
        return state.running


async def reap_orphan(entry: LedgerTask, node_id: str, now: float, bus: Bus) -> None:
    """Kill what is left of a task an earlier agent ran and report its exit (once: the
    event's msg_id is the same one the earlier agent would have used)."""
    pids = await asyncio.to_thread(find_task_processes, entry.task_id, entry.attempt, node_id)
    killed = kill_pids(pids)
    event = orphan_exit(
        entry, node_id, killed, now,
        stdout_tail=read_tail(Path(entry.stdout_path), STDOUT_TAIL_BYTES),
        stderr_tail=read_tail(Path(entry.stderr_path), STDERR_TAIL_BYTES))
    log.warning("task.orphan_reaped", task_id=entry.task_id, attempt=entry.attempt,
                killed=killed, reason=event.reason)
    subject = subjects.task_events(entry.run_id, entry.step, subjects.node_sender(node_id))
    await bus.publish(subject, event,
                      msg_id=f"{entry.task_id}:{entry.attempt}:exited")
