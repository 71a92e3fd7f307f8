"""`m27 up` / `m27 down` / `m27 status`: the whole system on one machine, no cluster needed.

`up` starts a real nats-server (JetStream store under `$M27_HOME/nats`) and every service as
its own background process on loopback, waits until each is ready, and records what runs in
`$M27_HOME/embedded.json`. Runs live in JetStream, so `down` then `up` keeps them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import msgspec

from m27.common.errors import M27Error
from m27.embedded.nats_server import NatsServer, pid_alive, stop_process
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
                           grpc_address=p.grpc_address, log_path=p.log_path)
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
       log_level: str = "info") -> tuple[EmbeddedState, bool]:
    """Start everything (or find it running); returns (state, started_now)."""
    if nodes < 1 or nodes > 64:
        raise M27Error(f"--nodes must be between 1 and 64, got {nodes}")
    with _locked(home):
        current = read_state(home)
        if is_up(current):
            assert current is not None
            return current, False
        if current is not None:
            _stop_state(current)  # some part died: restart all of it cleanly
        return _start(home, nodes, gpus, log_level), True


def _start(home: Path, nodes: int, gpus: str | None, log_level: str) -> EmbeddedState:
    gpu_spec, simulated = (gpus, gpus.startswith("sim")) if gpus else default_gpus()
    nats = NatsServer(home / "nats", server_name="m27-embedded")
    nats_url = nats.start(detached=True)
    assert nats.pid is not None
    log_dir = home / "logs"
    common = ["--nats", nats_url, "--log-level", log_level, "--log-json"]
    specs: list[tuple[str, str, list[str]]] = [("orchestrator", "m27.orchestrator", []),
             ("scheduler", "m27.scheduler", []),
             ("checkpoint-store", "m27.checkpoint_store", []),
             ("report", "m27.report", [])]
    specs += [(f"node-agent-{i}", "m27.node_agent",
               ["--node-id", f"node-{i}", "--instance", f"node-{i}", "--gpus", gpu_spec])
              for i in range(1, nodes + 1)]
    processes = [launch(name, module, [*common, *args], log_dir=log_dir, detached=True)
                 for name, module, args in specs]
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
def stored_nats(home: Path) -> Iterator[str | None]:
    """While the system is down: a nats-server of its own on the JetStream data `up` left
    under `home` (loopback, a free port, stopped on leaving), to read the runs kept there;
    None when `home` holds no such data. M27Error while the system runs (ask its API)."""
    with _locked(home):  # no `up` starts on the same store meanwhile
        if read_state(home) is not None:
            raise M27Error(f"m27 is (partly) running under {home}: ask it, or run `m27 down`")
        nats = NatsServer(home / "nats", server_name="m27-embedded")
        if not nats.store_dir.is_dir():
            yield None
            return
        url = nats.start()
        try:
            yield url
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
        "gpus": state.gpus,
        "simulated_gpus": state.simulated_gpus,
        "up": all(r.alive for r in rows),
        "processes": [msgspec.to_builtins(r) for r in rows],
    }, indent=2)
