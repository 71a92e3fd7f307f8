"""`m27 up` / `m27 down` / `m27 status`: the whole system on one machine, no cluster needed.

`up` starts a real nats-server (JetStream store under `$M27_HOME/nats`) and every service as
its own background process on loopback, waits until each is ready, and records what runs in
`$M27_HOME/embedded.json`. Runs live in JetStream, so `down` then `up` keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import msgspec

from m27.common.api_auth import ensure_cli_token, login_name
from m27.common.bus import Access, NatsBus, access_for
from m27.common.config import NatsSection
from m27.common.credentials import authorization, ensure_seeds, seed_path
from m27.common.errors import M27Error
from m27.common.principals import Principal, deployment, principal
from m27.embedded.nats_server import NatsServer, ServerTls, pid_alive, stop_process
from m27.embedded.processes import ServiceProcess, launch, stop, wait_ready

STATE_FILE: Final = "embedded.json"
LOCK_FILE: Final = "embedded.lock"
DEFAULT_SIMULATED_GPUS: Final = "sim:2"
START_TIMEOUT_S: Final = 60.0


class EmbeddedState(msgspec.Struct, kw_only=True):
    """What `m27 up` started; `m27 status --json` prints this shape."""

    home: str
    nats_url: str
    nats_pid: int
    api: str
    processes: list[ServiceProcess]
    started_at: float
    gpus: str
    simulated_gpus: bool


class ProcessStatus(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    alive: bool
    grpc_address: str = ""
    log_path: str = ""
    http_address: str = ""


def dashboard_url(state: EmbeddedState) -> str:
    """The report service's live dashboard (`http://host:port/`), "" when it serves none."""
    address = next((p.http_address for p in state.processes
                    if p.name == "report" and p.http_address), "")
    return f"http://{address}/" if address else ""


def state_path(home: Path) -> Path:
    return home / STATE_FILE


def read_state(home: Path) -> EmbeddedState | None:
    try:
        return msgspec.json.decode(state_path(home).read_bytes(), type=EmbeddedState)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def statuses(state: EmbeddedState) -> list[ProcessStatus]:
    rows = [ProcessStatus(name="nats-server", pid=state.nats_pid,
                          alive=pid_alive(state.nats_pid), grpc_address="",
                          log_path=str(Path(state.home) / "nats" / "nats.log"))]
    rows += [ProcessStatus(name=p.name, pid=p.pid, alive=pid_alive(p.pid),
                           grpc_address=p.grpc_address, log_path=p.log_path,
                           http_address=p.http_address)
             for p in state.processes]
    return rows


def is_up(state: EmbeddedState | None) -> bool:
    return state is not None and all(s.alive for s in statuses(state))


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
       log_level: str = "info", config: NatsSection | None = None, telegram: bool = False
       ) -> tuple[EmbeddedState, bool]:
    """Start everything (or find it running); returns (state, started_now). `telegram`:
    the Telegram bot too (a token is configured; it reads `[telegram]` itself)."""
    if nodes < 1 or nodes > 64:
        raise M27Error(f"--nodes must be between 1 and 64, got {nodes}")
    with _locked(home):
        current = read_state(home)
        if is_up(current):
            assert current is not None
            return current, False
        if current is not None:
            _stop_state(current)  # some part died: restart all of it cleanly
        return _start(home, nodes, gpus, log_level, config or NatsSection(), telegram), True


def credentials_dir(home: Path) -> Path:
    """Where `up` keeps the embedded bus's nkey seeds (0700, each file 0600)."""
    return home / "credentials" / "nats"


def access(home: Path, who: Principal, config: NatsSection) -> Access:
    """How `who` connects to the embedded bus under `home`."""
    return msgspec.structs.replace(
        access_for(config, who), seed_file=str(seed_path(credentials_dir(home), who)))


def embedded_server(home: Path, config: NatsSection, nodes: int) -> NatsServer:
    """The embedded nats-server: users for every principal (seeds made if missing), TLS
    when `[nats] server_cert` and `server_key` are set (mutual with `tls_cert` too)."""
    keys = ensure_seeds(credentials_dir(home),
                        deployment(f"node-{i}" for i in range(1, nodes + 1)))
    tls = None
    if config.server_cert or config.server_key:
        if not (config.server_cert and config.server_key):
            raise M27Error("[nats] server_cert and server_key go together")
        tls = ServerTls(cert=config.server_cert, key=config.server_key,
                        ca=config.tls_ca if config.tls_cert else "")
    return NatsServer(home / "nats", server_name="m27-embedded",
                      authorization=authorization(keys), tls=tls)


def _create_topology(url: str, admin: Access) -> None:
    async def create() -> None:
        bus = await NatsBus.open(url, name="m27-up", access=admin, create=True)
        await bus.close()

    asyncio.run(create())


def _start(home: Path, nodes: int, gpus: str | None, log_level: str,
           config: NatsSection, telegram: bool = False) -> EmbeddedState:
    gpu_spec, simulated = (gpus, gpus.startswith("sim")) if gpus else default_gpus()
    ensure_cli_token(home, login_name())  # the API's keys, and the CLI's admin token
    nats = embedded_server(home, config, nodes)
    nats_url = nats.start(detached=True)
    assert nats.pid is not None
    try:
        _create_topology(nats_url, access(home, principal("admin"), config))
    except M27Error:
        stop_process(nats.pid, 5)
        raise
    log_dir = home / "logs"
    common = ["--nats", nats_url, "--log-level", log_level, "--log-json"]
    specs: list[tuple[str, str, Principal, list[str]]] = [
        ("orchestrator", "m27.orchestrator", principal("orchestrator"), []),
        ("scheduler", "m27.scheduler", principal("scheduler"), []),
        ("checkpoint-store", "m27.checkpoint_store", principal("checkpoint-store"), []),
        ("report", "m27.report", principal("report"), [])]
    if telegram:
        specs.append(("telegram", "m27.telegram", principal("telegram"), []))
    specs += [(f"node-agent-{i}", "m27.node_agent", principal("node-agent", f"node-{i}"),
               ["--node-id", f"node-{i}", "--instance", f"node-{i}", "--gpus", gpu_spec])
              for i in range(1, nodes + 1)]
    seeds = credentials_dir(home)
    processes = [launch(name, module, [*common, "--nats-credentials",
                                       str(seed_path(seeds, who)), *args],
                        log_dir=log_dir, detached=True)
                 for name, module, who, args in specs]
    try:
        wait_ready(processes, timeout=START_TIMEOUT_S)
    except M27Error:
        stop(processes, timeout=5)
        stop_process(nats.pid, 5)
        raise
    api = next(p.grpc_address for p in processes if p.name == "orchestrator")
    state = EmbeddedState(home=str(home), nats_url=nats_url, nats_pid=nats.pid, api=api,
                          processes=processes, started_at=time.time(), gpus=gpu_spec,
                          simulated_gpus=simulated)
    _write_state(home, state)
    return state


def _write_state(home: Path, state: EmbeddedState) -> None:
    path = state_path(home)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, path)


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
        if not (home / "nats" / "jetstream").is_dir():
            yield None
            return
        nats = embedded_server(home, config, nodes=0)
        url = nats.start()
        try:
            yield url, access(home, principal("admin"), config)
        finally:
            nats.stop()


def down(home: Path) -> EmbeddedState | None:
    """Stop every process `up` started (services first, NATS last); None if none ran."""
    with _locked(home):
        current = read_state(home)
        if current is None:
            return None
        _stop_state(current)
        return current


def _stop_state(state: EmbeddedState) -> None:
    stop(state.processes, timeout=20)
    stop_process(state.nats_pid, 10)
    state_path(Path(state.home)).unlink(missing_ok=True)


def status_json(state: EmbeddedState, dead_letters: int | None = None) -> str:
    """The documented `m27 status --json` shape (plus liveness and log paths)."""
    rows = statuses(state)
    return json.dumps({
        "dead_letters": dead_letters,
        "home": state.home,
        "nats_url": state.nats_url,
        "api": state.api,
        "dashboard": dashboard_url(state),
        "gpus": state.gpus,
        "simulated_gpus": state.simulated_gpus,
        "up": all(r.alive for r in rows),
        "processes": [msgspec.to_builtins(r) for r in rows],
    }, indent=2)
