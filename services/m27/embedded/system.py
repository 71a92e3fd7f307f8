"""`m27 up` / `m27 down` / `m27 status`: the whole system on one machine, no cluster needed.

`up` starts a real nats-server (JetStream store under `$M27_HOME/nats`) and every service as
its own background process on loopback, waits until each is ready, and records what runs in
`$M27_HOME/embedded.json`. Runs live in JetStream, so `down` then `up` keeps them.

With `nats_cluster=3` it starts three nats-servers as one JetStream cluster instead (stores
under `$M27_HOME/nats-cluster/server-<i>`), creates every stream and bucket with 3 replicas
and gives each service the servers' URLs in a different order, so the services spread over
them and each fails over to another server when its own dies. `up` again while only some of
those servers are dead starts just them, and they rejoin.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import msgspec

from m27.common.api_auth import ensure_cli_token, login_name
from m27.common.bus import Access, NatsBus, access_for, connect
from m27.common.config import NatsSection
from m27.common.credentials import SEED_SUFFIX, authorization, ensure_seeds, seed_path
from m27.common.errors import BusError, M27Error
from m27.common.principals import NODE_ID, Principal, deployment, principal
from m27.common.subjects import RUNS_BUCKET
from m27.embedded.nats_cluster import NatsCluster, run_blocking, wait_for_jetstream
from m27.embedded.nats_server import (
    NatsServer,
    ServerTls,
    pid_alive,
    spawn,
    stop_process,
)
from m27.embedded.nats_server import wait_ready as wait_server_ready
from m27.embedded.processes import ServiceProcess, launch, stop, wait_ready

STATE_FILE: Final = "embedded.json"
LOCK_FILE: Final = "embedded.lock"
DEFAULT_SIMULATED_GPUS: Final = "sim:2"
START_TIMEOUT_S: Final = 60.0
CLUSTER_DIR: Final = "nats-cluster"
CLUSTER_REPLICAS: Final = 3
SIZE_FILE: Final = "nats-servers"  # how many the last `up` ran
ADMIT_TIMEOUT_S: Final = 10.0


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
    `nats_servers` has each."""

    home: str
    nats_url: str
    nats_pid: int
    api: str
    processes: list[ServiceProcess]
    started_at: float
    gpus: str
    simulated_gpus: bool
    nats_servers: list[NatsProcess] = msgspec.field(default_factory=list)


class ProcessStatus(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    alive: bool
    grpc_address: str = ""
    log_path: str = ""
    http_address: str = ""
    nats_url: str = ""  # a nats-server's client URL


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
       log_level: str = "info", config: NatsSection | None = None, telegram: bool = False,
       nats_cluster: int = 1) -> tuple[EmbeddedState, bool]:
    """Start everything (or find it running); returns (state, started_now). `telegram`:
    the Telegram bot too (a token is configured; it reads `[telegram]` itself).
    `nats_cluster`: 3 (or 5) nats-servers as one JetStream cluster, streams and buckets
    with 3 replicas; when only some of a running cluster's servers are dead, they alone
    are started again (and rejoin), and the state says (started_now False)."""
    if nodes < 1 or nodes > 64:
        raise M27Error(f"--nodes must be between 1 and 64, got {nodes}")
    if nats_cluster not in (1, 3, 5):
        raise M27Error(f"--nats-cluster must be 1, 3 or 5 (an odd number of servers keeps a "
                       f"majority when one dies), got {nats_cluster}")
    with _locked(home):
        current = read_state(home)
        if current is not None and _only_nats_members_down(current):
            revive_nats(current)
            _write_state(home, current)
        if is_up(current):
            assert current is not None
            return current, False
        if current is not None:
            _stop_state(current)  # some part died: restart all of it cleanly
        return _start(home, nodes, gpus, log_level, config or NatsSection(), telegram,
                      nats_cluster), True


def _only_nats_members_down(state: EmbeddedState) -> bool:
    """Some servers of a NATS cluster are dead, but a majority and every service live."""
    if not state.nats_servers or not all(pid_alive(p.pid) for p in state.processes):
        return False
    alive = sum(pid_alive(n.pid) for n in state.nats_servers)
    return len(state.nats_servers) // 2 < alive < len(state.nats_servers)


def revive_nats(state: EmbeddedState) -> list[str]:
    """Start each dead server of the embedded NATS cluster again with its own config (the
    same ports, name and store): it rejoins the cluster and catches up. Returns the names
    of those started; `state` is updated (not written)."""
    started = []
    for member in state.nats_servers:
        if pid_alive(member.pid):
            continue
        config_path = Path(member.config_path)
        ports = config_path.parent / "ports"  # as NatsServer lays its files out
        for stale in ports.glob("*.ports"):
            stale.unlink()
        process = spawn(config_path, Path(member.log_path), detached=True)
        member.pid = process.pid
        wait_server_ready(process, ports, Path(member.log_path))
        started.append(member.name)
    return started


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
    auth, tls = _server_security(home, config, nodes)
    return NatsServer(home / "nats", server_name="m27-embedded", authorization=auth, tls=tls)


def embedded_cluster(home: Path, config: NatsSection, nodes: int, size: int) -> NatsCluster:
    """The embedded NATS as a JetStream cluster of `size` servers on loopback, with the
    same users and TLS as the single server."""
    auth, tls = _server_security(home, config, nodes)
    return NatsCluster(home / CLUSTER_DIR, size, prefix="m27-embedded-", authorization=auth,
                       tls=tls)


def _server_security(home: Path, config: NatsSection, nodes: int
                     ) -> tuple[str, ServerTls | None]:
    keys = ensure_seeds(credentials_dir(home), _principals(home, nodes))
    tls = None
    if config.server_cert or config.server_key:
        if not (config.server_cert and config.server_key):
            raise M27Error("[nats] server_cert and server_key go together")
        tls = ServerTls(cert=config.server_cert, key=config.server_key,
                        ca=config.tls_ca if config.tls_cert else "")
    return authorization(keys), tls


def _principals(home: Path, nodes: int) -> list[Principal]:
    """Who the embedded bus admits: every service, its own nodes `node-1`…`node-<nodes>`,
    and every other node whose seed is in its credentials directory (a host that joins
    with `m27 agent`; `m27 bus credentials $M27_HOME/credentials/nats --nodes ID` puts
    it there)."""
    own = {f"node-{i}" for i in range(1, nodes + 1)}
    return deployment(sorted(own | set(joined_nodes(home))))


def joined_nodes(home: Path) -> list[str]:
    """Node ids whose seeds (`node-<id>.nk`) are in the embedded bus's credentials."""
    found = []
    for path in sorted(credentials_dir(home).glob(f"node-*{SEED_SUFFIX}")):
        node_id = path.name[len("node-"):-len(SEED_SUFFIX)]
        if NODE_ID.fullmatch(node_id):
            found.append(node_id)
    return found


def admit_nodes(home: Path) -> list[str]:
    """Let the nodes whose seeds were added to `credentials_dir(home)` since `m27 up`
    onto the running bus: each server's config gets the new users and is reloaded
    (SIGHUP), and this waits until the bus takes each new seed. Returns the node ids
    admitted now ([] when nothing runs or nothing is new)."""
    with _locked(home):
        state = read_state(home)
        if state is None or not is_up(state):
            return []
        keys = ensure_seeds(credentials_dir(home), _principals(home, 0))
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


def _create_topology(url: str, admin: Access, replicas: int = 1) -> None:
    async def create() -> None:
        if replicas > 1:  # a cluster answers once its members have elected a meta leader
            await wait_for_jetstream(url, access=admin)
        bus = await NatsBus.open(url, name="m27-up", access=admin, create=True,
                                 replicas=replicas)
        await bus.close()

    run_blocking(create)


def _start_nats(home: Path, config: NatsSection, nodes: int, size: int
                ) -> tuple[list[str], list[NatsProcess]]:
    """The embedded bus, started detached: its client URLs and each server's record; the
    topology created with 1 replica, or CLUSTER_REPLICAS on a cluster."""
    admin = access(home, principal("admin"), config)
    if size == 1:
        nats = embedded_server(home, config, nodes)
        url = nats.start(detached=True)
        assert nats.pid is not None
        members = [NatsProcess(name="nats-server", pid=nats.pid, url=url,
                               config_path=str(nats.config_path), log_path=str(nats.log_path))]
        replicas = 1
    else:
        cluster = embedded_cluster(home, config, nodes, size)
        cluster.start(detached=True)
        members = [NatsProcess(name=f"nats-server-{i}", pid=server.pid or 0,
                               url=server.url or "", config_path=str(server.config_path),
                               log_path=str(server.log_path))
                   for i, server in enumerate(cluster.servers, start=1)]
        replicas = CLUSTER_REPLICAS
    urls = [member.url for member in members]
    try:
        _create_topology(",".join(urls), admin, replicas)
    except M27Error:
        for member in members:
            stop_process(member.pid, 5)
        raise
    return urls, members


def rotated(urls: list[str], start: int) -> str:
    """The servers' URLs starting at the `start`-th (modulo their number), comma-separated:
    a client tries them in that order, so clients given different starts spread out."""
    shift = start % len(urls)
    return ",".join(urls[shift:] + urls[:shift])


def _start(home: Path, nodes: int, gpus: str | None, log_level: str,
           config: NatsSection, telegram: bool = False, nats_cluster: int = 1
           ) -> EmbeddedState:
    gpu_spec, simulated = (gpus, gpus.startswith("sim")) if gpus else default_gpus()
    ensure_cli_token(home, login_name())  # the API's keys, and the CLI's admin token
    urls, members = _start_nats(home, config, nodes, nats_cluster)
    (home / SIZE_FILE).write_text(f"{nats_cluster}\n")  # which store `stored_nats` reads
    nats_url = ",".join(urls)
    nats_pids = [m.pid for m in members]
    log_dir = home / "logs"
    common = ["--log-level", log_level, "--log-json"]
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
    processes = [launch(name, module, ["--nats", rotated(urls, i), *common,
                                       "--nats-credentials", str(seed_path(seeds, who)),
                                       *args],
                        log_dir=log_dir, detached=True)
                 for i, (name, module, who, args) in enumerate(specs)]
    try:
        wait_ready(processes, timeout=START_TIMEOUT_S)
    except M27Error:
        stop(processes, timeout=5)
        for pid in nats_pids:
            stop_process(pid, 5)
        raise
    api = next(p.grpc_address for p in processes if p.name == "orchestrator")
    state = EmbeddedState(home=str(home), nats_url=nats_url, nats_pid=nats_pids[0], api=api,
                          processes=processes, started_at=time.time(), gpus=gpu_spec,
                          simulated_gpus=simulated,
                          nats_servers=members if nats_cluster > 1 else [])
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
    stop(state.processes, timeout=20)
    pids = [n.pid for n in state.nats_servers] or [state.nats_pid]
    for pid in pids:  # all at once: each waits for the others while it shuts down
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        stop_process(pid, 10)
    state_path(Path(state.home)).unlink(missing_ok=True)


def status_json(state: EmbeddedState, dead_letters: int | None = None) -> str:
    """The documented `m27 status --json` shape (plus liveness and log paths)."""
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
        "up": all(r.alive for r in rows),
        "processes": [msgspec.to_builtins(r) for r in rows],
    }, indent=2)
