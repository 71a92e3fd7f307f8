"""The node's lease: what lets its tasks run, and what stops them when it lapses.

Every heartbeat interval the agent renews its lease by storing its NodeInfo (with a new
`seq`) in KV; only once that write is acknowledged does it publish the heartbeat. The
scheduler declares the node lost `node_timeout` (15 s) after the last renewal it *saw*;
the agent fences itself `fence_after` (10 s) after the last renewal it got *acknowledged*,
which is never later. So a node cut off from NATS has killed its tasks before the scheduler
starts them elsewhere. Both sides measure with their own monotonic clocks: no clock on one
machine is compared with a clock on another.

The deadline is also written to a lease file that the guard process (`m27.node_agent.guard`)
watches, so tasks are fenced even when the agent itself is frozen or killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

CLOSED: Final = "closed"


def lease_path(home: Path, node_id: str) -> Path:
    return home / "nodes" / node_id / "lease.json"


@dataclass
class Lease:
    """The agent's side: when the lease was last renewed, and until when it holds."""

    node_id: str
    fence_after_s: float
    path: Path  # lease_path(home, node_id)
    renewed_at: float | None = None  # monotonic
    renewals: int = 0

    @property
    def deadline(self) -> float | None:
        return None if self.renewed_at is None else self.renewed_at + self.fence_after_s

    def expired(self, now: float) -> bool:
        """True once the last acknowledged renewal is older than fence_after."""
        deadline = self.deadline
        return deadline is not None and now > deadline

    def renewed(self, now: float) -> None:
        self.renewed_at = now
        self.renewals += 1
        write_lease_file(self.path, {"node_id": self.node_id, "deadline": self.deadline,
                                     "agent_pid": os.getpid()})

    def close(self) -> None:
        """A clean shutdown: the guard stops watching (the agent stopped its tasks itself)."""
        write_lease_file(self.path, {"node_id": self.node_id, "deadline": None,
                                     "agent_pid": os.getpid(), "state": CLOSED})


def write_lease_file(path: Path, data: dict[str, object]) -> None:
    """Atomic replace: the guard never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_lease_file(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def monotonic() -> float:
    """The clock leases are measured with: system-wide on Linux, so the agent and its guard
    (two processes on one machine) agree on it; never affected by wall-clock changes."""
    return time.monotonic()


GUARD_SCRIPT: Final = Path(__file__).with_name("_guard.py")


def start_guard(lease_file: Path, ledger_file: Path, node_id: str) -> subprocess.Popen[bytes]:
    """Start the node's guard in its own session, logging next to the lease file."""
    log_file = lease_file.with_name("guard.log")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-S", str(GUARD_SCRIPT), "--lease", str(lease_file),
             "--ledger", str(ledger_file), "--node-id", node_id,
             "--agent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)


def stop_guard(guard: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """After `Lease.close`, the guard exits by itself; reap it (kill it if it does not)."""
    if guard is None:
        return
    try:
        guard.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait(timeout=timeout)
