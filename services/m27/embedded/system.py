"""`m27 up` / `m27 down` / `m27 status`: the whole system on one machine, no cluster needed.

`up` starts the supervisor (m27.embedded.supervisor), which starts a real nats-server
(JetStream store under `$M27_HOME/nats`) and every service as its children on loopback,
and returns once each is ready; what runs is in `$M27_HOME/embedded.json`, which the
supervisor keeps current. A process that exits is started again after a backoff, one that
keeps exiting is given up on and shown as crash-looping (m27.embedded.restarts). Runs live
in JetStream, so `down` then `up` keeps them.

With `nats_cluster=3` the bus is three nats-servers as one JetStream cluster instead
(stores under `$M27_HOME/nats-cluster/server-<i>`), every stream and bucket with 3
replicas, and each service is given the servers' URLs in a different order, so the
services spread over them and each fails over to another server when its own dies; a dead
server is started again on its own config and rejoins.

`up` again while everything runs changes nothing; while something waits for its restart
or was given up on, it asks the supervisor to start it now (and fails with its log if it
exits again); when the supervisor itself is gone, it stops whatever is left and starts
everything afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import msgspec

from m27.common.api_auth import ensure_cli_token, login_name
from m27.common.bus import Access, connect
from m27.common.config import NatsSection, SupervisorSection
from m27.common.credentials import authorization, ensure_seeds, seed_path
from m27.common.errors import BusError, M27Error
from m27.common.principals import principal
from m27.common.subjects import RUNS_BUCKET
from m27.embedded.bus_setup import (
    CLUSTER_REPLICAS,
    SIZE_FILE,
    access,
    credentials_dir,
    embedded_cluster,
    embedded_server,
    joined_nodes,
    principals,
)
from m27.embedded.nats_cluster import run_blocking, wait_for_jetstream
from m27.embedded.nats_server import pid_alive, stop_process, tail
from m27.embedded.processes import stop
from m27.embedded.restarts import describe_exit
from m27.embedded.state import (
    STATE_FILE,
    EmbeddedState,
    NatsProcess,
    Supervision,
    read_state,
    state_path,
)
from m27.embedded.supervisor import Plan, Report

__all__ = [
    "CLUSTER_REPLICAS", "STATE_FILE", "EmbeddedState", "NatsProcess", "ProcessStatus",
    "access", "admit_nodes", "credentials_dir", "dashboard_url", "default_gpus", "down",
    "embedded_cluster", "embedded_server", "is_up", "joined_nodes", "last_nats_size",
    "read_state", "state_path", "status_json", "statuses", "stored_nats", "supervised", "up",
]

LOCK_FILE: Final = "embedded.lock"
DEFAULT_SIMULATED_GPUS: Final = "sim:2"
ADMIT_TIMEOUT_S: Final = 10.0
#: The supervisor's own waits (NATS, the topology, every service) fit well inside this.
START_TIMEOUT_S: Final = 180.0
#: It stops the services (20 s at most) and then NATS (10 s at most).
SUPERVISOR_STOP_S: Final = 45.0
#: `up` while something is down: how long the supervisor gets to start it again.
REVIVE_TIMEOUT_S: Final = 60.0


class ProcessStatus(msgspec.Struct, kw_only=True):
    """A row of `m27 status`: a process, whether it lives, and how its supervision went."""

    name: str
    pid: int
    alive: bool
    grpc_address: str = ""
    log_path: str = ""
    http_address: str = ""
    nats_url: str = ""  # a nats-server's client URL
    # starting | running | restarting | gave-up | stopped (state.ProcessState), or dead:
    # not running and no supervisor to start it again
    state: str = "running"
    restarts: int = 0
    last_exit: str = ""
    last_exit_at: float = 0.0
    restart_at: float = 0.0
    reason: str = ""
    crash_looping: bool = False  # exited too often: the supervisor gave up on it


def dashboard_url(state: EmbeddedState) -> str:
    """The report service's live dashboard (`http://host:port/`), "" when it serves none."""
    address = next((p.http_address for p in state.processes
                    if p.name == "report" and p.http_address), "")
    return f"http://{address}/" if address else ""


def supervised(state: EmbeddedState) -> bool:
    """Whether the supervisor that started `state` still runs."""
    return state.supervisor_pid > 0 and pid_alive(state.supervisor_pid)


def statuses(state: EmbeddedState) -> list[ProcessStatus]:
    rows = [ProcessStatus(name=n.name, pid=n.pid, alive=pid_alive(n.pid), log_path=n.log_path,
                          nats_url=n.url)
            for n in state.nats_servers] or [
        ProcessStatus(name="nats-server", pid=state.nats_pid, alive=pid_alive(state.nats_pid),
                      grpc_address="", log_path=str(Path(state.home) / "nats" / "nats.log"),
                      nats_url=state.nats_url)]
    rows += [ProcessStatus(name=p.name, pid=p.pid, alive=pid_alive(p.pid),
                           grpc_address=p.grpc_address, log_path=p.log_path,
                           http_address=p.http_address)
             for p in state.processes]
    watching = supervised(state)
    for row in rows:
        _add_supervision(row, state.supervision.get(row.name), watching)
    return rows


def _add_supervision(row: ProcessStatus, info: Supervision | None, watching: bool) -> None:
    if info is not None:
        row.state, row.restarts, row.last_exit = info.state, info.restarts, info.last_exit
        row.last_exit_at, row.restart_at, row.reason = (info.last_exit_at, info.restart_at,
                                                        info.reason)
    if not watching and row.state not in ("gave-up", "stopped"):
        row.state, row.restart_at = ("running" if row.alive else "dead"), 0.0
    row.crash_looping = row.state == "gave-up"


def is_up(state: EmbeddedState | None) -> bool:
    """Everything runs and is ready, and the supervisor watches over it."""
    return state is not None and supervised(state) and all(
        s.alive and s.state == "running" for s in statuses(state))


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """One `up`/`down` at a time per $M27_HOME."""
    home.mkdir(parents=True, exist_ok=True)
    with (home / LOCK_FILE).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def default_gpus() -> tuple[str, bool]:
    """(`--gpus` for the node-agents, simulated?): real GPUs through NVML when present."""
    return ("auto", False) if nvidia_gpu_count() > 0 else (DEFAULT_SIMULATED_GPUS, True)


def nvidia_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no device: all mean "no NVIDIA GPU"
        return 0


def up(home: Path, *, nodes: int = 1, gpus: str | None = None,
       log_level: str = "info", config: NatsSection | None = None, telegram: bool = False,
       nats_cluster: int = 1, policy: SupervisorSection | None = None
       ) -> tuple[EmbeddedState, bool]:
    """Start everything (or find it running); returns (state, started_now). `telegram`:
    the Telegram bot too (a token is configured; it reads `[telegram]` itself).
    `nats_cluster`: 3 (or 5) nats-servers as one JetStream cluster, streams and buckets
    with 3 replicas. `policy`: how the supervisor restarts what exits (`[supervisor]`).
    While the supervisor runs but something is down, it is asked to start that now
    (started_now False; M27Error when it exits again, the rest left running); the system
    is started afresh only when the supervisor is gone."""
    if nodes < 1 or nodes > 64:
        raise M27Error(f"--nodes must be between 1 and 64, got {nodes}")
    if nats_cluster not in (1, 3, 5):
        raise M27Error(f"--nats-cluster must be 1, 3 or 5 (an odd number of servers keeps a "
                       f"majority when one dies), got {nats_cluster}")
    with _locked(home):
        current = read_state(home)
        if current is not None and supervised(current) and not is_up(current):
            current = _revive(home, current)  # M27Error: it will not stay up
        if current is not None and is_up(current):
            return current, False
        if current is not None:
            _stop_state(current)  # what is left of it, so all of it starts cleanly
        gpu_spec, simulated = (gpus, gpus.startswith("sim")) if gpus else default_gpus()
        plan = Plan(home=str(home), nodes=nodes, gpus=gpu_spec, simulated=simulated,
                    log_level=log_level, nats=config or NatsSection(),
                    policy=policy or SupervisorSection(), telegram=telegram,
                    nats_cluster=nats_cluster)
        return _start(home, plan), True


def _revive(home: Path, state: EmbeddedState) -> EmbeddedState | None:
    """Ask the supervisor to start every process that waits for its restart or was given
    up on now (SIGUSR1), and wait until all run; the state then (None, or one without a
    supervisor: it died meanwhile). M27Error with its log's end when one exits again, or
    is not running after REVIVE_TIMEOUT_S: the rest keeps running."""
    asked = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.supervisor_pid, signal.SIGUSR1)
    deadline = time.monotonic() + REVIVE_TIMEOUT_S
    while True:
        time.sleep(0.1)
        latest = read_state(home)
        if latest is None or is_up(latest) or not supervised(latest):
            return latest
        again = [row for row in statuses(latest) if row.last_exit_at > asked]
        if again or time.monotonic() > deadline:
            row = (again or [r for r in statuses(latest) if r.state != "running"])[0]
            why = f"exited again ({row.last_exit})" if again else \
                f"is not running after {REVIVE_TIMEOUT_S:.0f}s"
            raise M27Error(f"{row.name} {why} when started again; everything else keeps "
                           f"running (`m27 status`). Its log ({row.log_path}) ends with:\n"
                           f"{tail(Path(row.log_path))}")


def _start(home: Path, plan: Plan) -> EmbeddedState:
    """Start the supervisor with `plan` and wait for its report: the state it wrote, or
    M27Error saying what failed (with the log's end)."""
    ensure_cli_token(home, login_name())  # the API's keys, and the CLI's admin token
    log_path = home / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    try:
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "m27.embedded.supervisor", "--report-fd",
                 str(write_fd)],
                stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                pass_fds=(write_fd,), start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "M27_LOG_FILE": str(log_path)})
    finally:
        os.close(write_fd)
    try:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: the report says so
            process.stdin.write(msgspec.json.encode(plan))
            process.stdin.close()
        report = _await_report(read_fd, process, log_path)
    finally:
        os.close(read_fd)
    if not report.ok:
        raise M27Error(report.error)
    state = read_state(home)
    if state is None or state.supervisor_pid != process.pid:
        raise M27Error(f"the supervisor said it started but wrote no state under {home}")
    return state


def _await_report(fd: int, process: subprocess.Popen[bytes], log_path: Path) -> Report:
    """The supervisor's one line on `fd`; M27Error when it exits or hangs instead."""
    deadline = time.monotonic() + START_TIMEOUT_S
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            stop_process(process.pid, SUPERVISOR_STOP_S, child=process)
            raise M27Error(f"m27 did not start in {START_TIMEOUT_S:.0f}s; the supervisor's "
                           f"log ({log_path}) ends with:\n{tail(log_path)}")
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            code = process.wait(timeout=10)
            raise M27Error(f"the supervisor exited while starting ({describe_exit(code)}); "
                           f"its log ({log_path}) ends with:\n{tail(log_path)}")
        data += chunk
    return msgspec.json.decode(data, type=Report)


def admit_nodes(home: Path) -> list[str]:
    """Let the nodes whose seeds were added to `credentials_dir(home)` since `m27 up`
    onto the running bus: each server's config gets the new users and is reloaded
    (SIGHUP), and this waits until the bus takes each new seed. Returns the node ids
    admitted now ([] when nothing runs or nothing is new)."""
    with _locked(home):
        state = read_state(home)
        if state is None or not is_up(state):
            return []
        keys = ensure_seeds(credentials_dir(home), principals(home, 0))
        block = authorization(keys)
        configs = [Path(n.config_path) for n in state.nats_servers] or [
            home / "nats" / "nats.conf"]
        text = configs[0].read_text()
        new = [who for who, key in keys.items() if who.node_id and key not in text]
        if not new:
            return []
        pids = [n.pid for n in state.nats_servers] or [state.nats_pid]
        for path, pid in zip(configs, pids, strict=True):
            current = path.read_text()
            # render_config writes the authorization block last
            path.write_text(current[:current.index("authorization: ")] + block + "\n")
            os.kill(pid, signal.SIGHUP)  # nats-server reloads its config
    run_blocking(lambda: _wait_admitted(state.nats_url, [
        seed_path(credentials_dir(home), who) for who in new]))
    return sorted(who.node_id for who in new)


async def _wait_admitted(url: str, seeds: list[Path]) -> None:
    for seed in seeds:
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while True:
            try:
                nc = await connect(url, name="m27-up-admit", timeout=2.0,
                                   access=Access(seed_file=str(seed)))
            except BusError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)
                continue
            await nc.close()
            break


@contextlib.contextmanager
def stored_nats(home: Path, config: NatsSection | None = None
                ) -> Iterator[tuple[str, Access] | None]:
    """While the system is down: a nats-server of its own on the JetStream data `up` left
    under `home` (loopback, a free port, the same users, stopped on leaving), to read the
    runs kept there, and the admin's access to it; None when `home` holds no such data.
    M27Error while the system runs (ask its API)."""
    config = config or NatsSection()
    with _locked(home):  # no `up` starts on the same store meanwhile
        if read_state(home) is not None:
            raise M27Error(f"m27 is (partly) running under {home}: ask it, or run `m27 down`")
        size = last_nats_size(home)
        if size > 1:
            with _stored_cluster(home, config, size) as url:
                yield url, access(home, principal("admin"), config)
            return
        if not (home / "nats" / "jetstream").is_dir():
            yield None
            return
        nats = embedded_server(home, config, nodes=0)
        url = nats.start()
        try:
            yield url, access(home, principal("admin"), config)
        finally:
            nats.stop()


def last_nats_size(home: Path) -> int:
    """How many NATS servers the last `up` under `home` ran (1 when it never said)."""
    try:
        return int((home / SIZE_FILE).read_text())
    except (OSError, ValueError):
        return 1


@contextlib.contextmanager
def _stored_cluster(home: Path, config: NatsSection, size: int) -> Iterator[str]:
    """The stored cluster's servers again (new ports, the same names and stores), until
    the runs' bucket has a leader; their URLs."""
    cluster = embedded_cluster(home, config, 0, size)
    cluster.start()
    try:
        admin = access(home, principal("admin"), config)
        run_blocking(lambda: wait_for_jetstream(cluster.url, access=admin,
                                                stream=f"KV_{RUNS_BUCKET}"))
        yield cluster.url
    finally:
        cluster.stop()


def down(home: Path) -> EmbeddedState | None:
    """Stop every process `up` started (services first, NATS last); None if none ran."""
    with _locked(home):
        current = read_state(home)
        if current is None:
            return None
        _stop_state(current)
        return current


def _stop_state(state: EmbeddedState) -> None:
    """Stop the supervisor, which stops everything it runs; then whatever still lives of
    what the state records (a supervisor that died left it running); forget it all."""
    home = Path(state.home)
    if supervised(state):
        stop_process(state.supervisor_pid, SUPERVISOR_STOP_S)
        state = read_state(home) or state  # the pids it had last
    if state.supervisor_pid:
        with contextlib.suppress(ChildProcessError):  # started by this very process
            os.waitpid(state.supervisor_pid, os.WNOHANG)
    stop([p for p in state.processes if pid_alive(p.pid)], timeout=20)
    pids = [pid for pid in [n.pid for n in state.nats_servers] or [state.nats_pid]
            if pid_alive(pid)]
    for pid in pids:  # all at once: each waits for the others while it shuts down
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        stop_process(pid, 10)
    state_path(home).unlink(missing_ok=True)


def status_json(state: EmbeddedState, dead_letters: int | None = None) -> str:
    """The documented `m27 status --json` shape (plus liveness, supervision, log paths)."""
    rows = statuses(state)
    return json.dumps({
        "dead_letters": dead_letters,
        "home": state.home,
        "nats_url": state.nats_url,
        "nats_servers": [msgspec.to_builtins(n) for n in state.nats_servers],
        "api": state.api,
        "dashboard": dashboard_url(state),
        "gpus": state.gpus,
        "simulated_gpus": state.simulated_gpus,
        "up": is_up(state),
        "supervisor": {"pid": state.supervisor_pid, "alive": supervised(state)},
        "processes": [msgspec.to_builtins(r) for r in rows],
    }, indent=2)
