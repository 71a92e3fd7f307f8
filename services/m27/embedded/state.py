"""What runs under `m27 up`, as `$M27_HOME/embedded.json` records it.

The supervisor writes the file (atomically) once everything is ready and again whenever a
process exits, waits to be restarted, is started again, becomes ready or is given up on;
`m27 status`, `m27 down` and the CLI's address lookups read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final, Literal

import msgspec

from m27.embedded.processes import ServiceProcess

STATE_FILE: Final = "embedded.json"

#: starting: started again, not ready yet; restarting: exited, started again at
#: `restart_at`; gave-up: exited too often (crash-looping), not restarted; stopped: the
#: supervisor stopped it (`m27 down`).
ProcessState = Literal["starting", "running", "restarting", "gave-up", "stopped"]


class Supervision(msgspec.Struct, kw_only=True):
    """What the supervisor knows about one process beyond its pid."""

    state: ProcessState = "running"
    restarts: int = 0  # times started again after an exit
    last_exit: str = ""  # `SIGKILL`, `exit code 1` (m27.embedded.restarts.describe_exit)
    last_exit_at: float = 0.0  # when (Unix time)
    restart_at: float = 0.0  # state restarting: when it is started again
    reason: str = ""  # the restart policy's last decision, in words


class NatsProcess(msgspec.Struct, kw_only=True):
    """One nats-server of a clustered embedded bus: how to find it and start it again."""

    name: str  # nats-server-<i>
    pid: int
    url: str
    config_path: str
    log_path: str


class EmbeddedState(msgspec.Struct, kw_only=True):
    """What `m27 up` started; `m27 status --json` prints this shape. With a NATS cluster,
    `nats_url` lists every server (comma-separated), `nats_pid` is the first one's and
    `nats_servers` has each. `supervisor_pid` restarts them; `supervision` says, by process
    name, how that went (an entry for every process)."""

    home: str
    nats_url: str
    nats_pid: int
    api: str
    processes: list[ServiceProcess]
    started_at: float
    gpus: str
    simulated_gpus: bool
    nats_servers: list[NatsProcess] = msgspec.field(default_factory=list)
    supervisor_pid: int = 0
    supervision: dict[str, Supervision] = msgspec.field(default_factory=dict)


def state_path(home: Path) -> Path:
    return home / STATE_FILE


def read_state(home: Path) -> EmbeddedState | None:
    try:
        return msgspec.json.decode(state_path(home).read_bytes(), type=EmbeddedState)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def write_state(home: Path, state: EmbeddedState) -> None:
    """Write-then-rename: a reader sees the old file or the new one, never half of one."""
    path = state_path(home)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, path)
