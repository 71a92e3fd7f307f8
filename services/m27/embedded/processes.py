"""Start service processes (`python -m m27.<service> ...`) and wait until each is ready.

Readiness is the `--ready-file` a service writes once NATS is connected, its topology ensured
and its gRPC health SERVING. Used by `m27 up` and by the integration-test fixtures, so tests
start services exactly the way users do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from m27.common.errors import M27Error
from m27.embedded.nats_server import pid_alive, tail


class ServiceProcess(msgspec.Struct, kw_only=True):
    """A started service: its process, where it logs, and (once ready) its gRPC address."""

    name: str
    module: str
    pid: int
    log_path: str
    ready_file: str
    grpc_address: str = ""
    http_address: str = ""  # a web page it serves (the report's dashboard)


def launch(name: str, module: str, args: Sequence[str], *, log_dir: Path,
           detached: bool = False, env: Mapping[str, str] | None = None) -> ServiceProcess:
    """Start `python -m <module> <args> --ready-file ...` with its output in `log_dir`."""
    return start_process(name, module, args, log_dir=log_dir, detached=detached, env=env)[0]


def start_process(name: str, module: str, args: Sequence[str], *, log_dir: Path,
                  detached: bool = False, env: Mapping[str, str] | None = None
                  ) -> tuple[ServiceProcess, subprocess.Popen[bytes]]:
    """`launch`, and the Popen: whoever keeps it learns the exit status (a dropped Popen
    of a running child is reaped by the next Popen made in this process)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    ready_file = log_dir / f"{name}.ready"
    ready_file.unlink(missing_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env["M27_LOG_FILE"] = str(log_path)  # the service rotates it (m27.common.logrotate)
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(ready_file)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=detached, env=child_env,
        )
    return ServiceProcess(name=name, module=module, pid=process.pid, log_path=str(log_path),
                          ready_file=str(ready_file)), process


def wait_ready(processes: Sequence[ServiceProcess], timeout: float = 60.0) -> None:
    """Wait for every ready file; M27Error with the log tail of one that died or hung."""
    deadline = time.monotonic() + timeout
    waiting = list(processes)
    while waiting:
        for proc in list(waiting):
            if check_ready(proc):
                waiting.remove(proc)
            elif not pid_alive(proc.pid):
                _reap(proc.pid)
                raise M27Error(f"{proc.name} exited while starting; its log "
                               f"({proc.log_path}) ends with:\n{tail(Path(proc.log_path))}")
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            last = waiting[0]
            raise M27Error(f"not ready after {timeout:.0f}s: {names}; {last.name}'s log ends "
                           f"with:\n{tail(Path(last.log_path))}")
        if waiting:
            time.sleep(0.05)


def check_ready(proc: ServiceProcess) -> bool:
    """True once this process (this pid) wrote its ready file; its addresses are then set."""
    data = _read_ready(Path(proc.ready_file))
    if data is None or data.get("pid") != proc.pid:
        return False
    proc.grpc_address = str(data.get("grpc_address", ""))
    proc.http_address = str(data.get("http_address", ""))
    return True


def stop(processes: Sequence[ServiceProcess], timeout: float = 15.0) -> None:
    """SIGTERM every process at once (in reverse order of start), wait for them together,
    SIGKILL what outlives `timeout`. One after the other, each shutdown's wait (a drain,
    a grace period) would add up."""
    for proc in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in reversed(processes):
        while pid_alive(proc.pid) and time.monotonic() < deadline:
            _reap(proc.pid)
            time.sleep(0.05)
        if pid_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        _reap(proc.pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _read_ready(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
