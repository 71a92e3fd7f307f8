"""The node's dead-man switch: kills the node's tasks when its lease lapses (stdlib only).

The node-agent starts one guard per node (`python <this file> --lease … --ledger …`). It
watches the lease file the agent rewrites after every acknowledged renewal. If the lease
deadline passes — the agent is frozen, killed, or cut off from NATS — the guard SIGKILLs
every process of every task the ledger says is running on this node (found by their
M27_TASK_ID / M27_ATTEMPT / M27_NODE_ID environment, so a process that left its group is
found too). The scheduler restarts those tasks elsewhere only after its own, longer lease
runs out, so a task is never running in two places. A clean agent shutdown closes the
lease and the guard exits.

It imports nothing from m27 (and nothing outside the standard library): it starts in
milliseconds and keeps working whatever the agent's process is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.2


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def task_processes(tasks: list[dict[str, Any]], node_id: str) -> list[int]:
    """Live pids whose environment names one of `tasks` on this node."""
    wanted = [{f"M27_TASK_ID={t['task_id']}".encode(), f"M27_ATTEMPT={t['attempt']}".encode(),
               f"M27_NODE_ID={node_id}".encode()} for t in tasks]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if any(keys <= environ for keys in wanted) and alive(int(entry)):
            found.append(int(entry))
    return found


def fence(ledger: Path, node_id: str) -> int:
    """SIGKILL every process of every running task of the ledger; how many were killed."""
    state = read_json(ledger) or {}
    tasks = [t for t in state.get("running", []) if isinstance(t, dict)]
    pids = task_processes(tasks, node_id) if tasks else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps({"timestamp": stamp, "service": "node-guard", "event": message}),
          file=sys.stderr, flush=True)


def watch(lease: Path, ledger: Path, node_id: str, agent_pid: int) -> int:
    """Until the agent closes the lease (or dies after its tasks are fenced)."""
    fenced_at_deadline: float | None = None
    while True:
        data = read_json(lease) or {}
        if data.get("state") == "closed":
            say("lease closed by the agent: guard exits")
            return 0
        deadline = data.get("deadline")
        expired = isinstance(deadline, int | float) and time.monotonic() > deadline
        if expired and fenced_at_deadline != deadline:
            killed = fence(ledger, node_id)
            say(f"lease expired: fenced the node's tasks ({killed} process(es) killed)")
            fenced_at_deadline = deadline
        if not alive(agent_pid) and (expired or deadline is None):
            say("agent gone: guard exits")
            return 0
        time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lease", type=Path, required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--agent-pid", type=int, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the lease decides; see watch()
    raise SystemExit(watch(args.lease, args.ledger, args.node_id, args.agent_pid))


if __name__ == "__main__":
    main()
