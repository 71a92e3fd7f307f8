"""Helpers for the integration tests: a whole m27 system on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import msgspec
from nats.js.errors import NotFoundError

from m27.client import Client
from m27.common import api_auth, tokens
from m27.common.api_auth import ApiAccess, Keys
from m27.common.bus import NatsBus
from m27.common.config import NatsSection, load_config
from m27.common.model import RunRecord
from m27.embedded import NatsServer, system
from m27.embedded.nats_cluster import NatsCluster, run_blocking, wait_for_jetstream
from m27.embedded.processes import ServiceProcess, launch, stop, wait_ready


def home_keys(home: Path) -> Keys:
    """The API keys under `home` (made if missing), as a control-plane service holds them."""
    control = api_auth.ensure_keys(api_auth.api_dir(home))
    return Keys.of_control(control)


def service_log(proc: ServiceProcess) -> str:
    return Path(proc.log_path).read_text(errors="replace")


class Cluster:
    """A whole m27 on loopback: nats-server (or a JetStream cluster of them) plus the five
    services as real processes."""

    def __init__(self, root: Path, nodes: int = 1, gpus: str = "sim:2",
                 env: dict[str, str] | None = None, api_tls: bool = False,
                 nats_servers: int = 1) -> None:
        """`api_tls`: every gRPC server on mutual TLS (`[api]` certificates), as a
        deployment beyond loopback must run. `nats_servers` 3 or 5: a JetStream cluster
        (streams and buckets with 3 replicas) whose servers tell clients no other
        member's address (a client keeps to the URLs it is given)."""
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        config = root / "m2config"
        self.certs = make_certificates(root / "tls") if api_tls else None
        config.write_text(api_tls_config(self.certs) if self.certs else "")
        token_file = api_auth.ensure_cli_token(self.home, api_auth.login_name())
        keys = token_file.parent  # named, so a node-agent with a home of its own has them
        self.env = {**os.environ, "M27_HOME": str(self.home), "M27_CONFIG": str(config),
                    "M27_API_KEY_FILE": str(keys / api_auth.CONTROL_KEY),
                    "M27_API_NODE_KEY_FILE": str(keys / api_auth.NODE_KEY), **(env or {})}
        self.nats: NatsServer | NatsCluster = NatsServer(root / "nats")
        if nats_servers > 1:
            self.nats = NatsCluster(root / "nats", nats_servers, advertise=False)
            self.env["M27_NATS_REPLICAS"] = "3"
        #: The admin's access `m27 up` would give; `access_as` makes other users'.
        self.access = self.with_token(token_file.read_text().strip())
        self.keys = home_keys(self.home)
        self.nodes = nodes
        self.gpus = gpus
        self.processes: dict[str, ServiceProcess] = {}

    def access_as(self, user: str, role: tokens.ApiRole = "user", **scope: object) -> ApiAccess:
        """A token for `user` in `role` (a step's: task_id=, attempt=), as an admin's
        `m27 api token create` (or a node-agent, for node and step tokens) would sign it."""
        return self.with_token(self.keys.mint(user=user, role=role, ttl_s=0.0,
                                              **scope))  # type: ignore[arg-type]

    def with_token(self, token: str) -> ApiAccess:
        """Calls carrying `token`, over TLS with a client certificate when the API has it."""
        if self.certs is None:
            return ApiAccess(token=token)
        return ApiAccess(token=token, tls_ca=str(self.certs.ca),
                         client_cert=str(self.certs.client_cert),
                         client_key=str(self.certs.client_key))

    def bare_channel(self, target: str) -> grpc.aio.Channel:
        """A channel that carries no token: plaintext, or TLS with a client certificate."""
        if self.certs is None:
            return grpc.aio.insecure_channel(target)
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(
            self.certs.ca.read_bytes(), self.certs.client_key.read_bytes(),
            self.certs.client_cert.read_bytes()))

    def client(self, access: ApiAccess | None = None) -> Client:
        """A client of this system's API (as its admin unless `access` says otherwise)."""
        return Client(self.api, access=access or self.access)

    @property
    def nats_url(self) -> str:
        assert self.nats.url is not None
        return self.nats.url

    @property
    def api(self) -> str:
        return self.processes["orchestrator"].grpc_address

    def start(self) -> None:
        self.nats.start()
        if isinstance(self.nats, NatsCluster):
            url = self.nats.url
            run_blocking(lambda: wait_for_jetstream(url))
        specs: list[tuple[str, str, list[str]]] = [
            ("orchestrator", "m27.orchestrator", []), ("scheduler", "m27.scheduler", []),
            ("checkpoint-store", "m27.checkpoint_store", []), ("report", "m27.report", [])]
        specs += [(f"node-agent-{i}", "m27.node_agent",
                   ["--node-id", f"node-{i}", "--gpus", self.gpus,
                    "--heartbeat-interval", "1s"]) for i in range(1, self.nodes + 1)]
        for name, module, args in specs:
            self.launch(name, module, args)
        wait_ready(list(self.processes.values()))

    def launch(self, name: str, module: str, args: Sequence[str] = (),
               env: dict[str, str] | None = None) -> ServiceProcess:
        """Start a service; `env` adds to (or overrides) the cluster's environment, e.g. a
        node-agent's own M27_HOME, as on a machine of its own."""
        proc = launch(name, module, ["--nats", self.nats_url, *args],
                      log_dir=self.root / "logs", env={**self.env, **(env or {})})
        self.processes[name] = proc
        return proc

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{service_log(p)[-3000:]}"
                         for name, p in self.processes.items())

    def stop(self) -> None:
        stop(list(self.processes.values()))
        self.nats.stop()



async def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def finished_run(client: Client, run_id: str, timeout: float = 90.0) -> RunRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = await client.get_run(run_id)
        if run.state in {"succeeded", "failed", "cancelled"}:
            return run
        await asyncio.sleep(0.1)
    raise AssertionError(f"run did not finish: {await client.get_run(run_id)}")


async def report_of(client: Client, run_id: str, timeout: float = 60.0) -> str:
    """The run's HTML report once the report service has written it (`report_path` is set
    when the orchestrator has seen `report_ready`)."""
    deadline = time.monotonic() + timeout
    while not (run := await client.get_run(run_id)).report_path:
        assert time.monotonic() < deadline, f"no report for {run_id}: {run}"
        await asyncio.sleep(0.1)
    return Path(run.report_path).read_text()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class TcpProxy:
    """A TCP forwarder the test controls, to cut a process off from NATS and reconnect it.

    `cut()` closes every forwarded connection and refuses new ones (accepts and closes them)
    until `heal()`. Runs its own event loop in a thread, so it keeps working whatever the
    test's loop is doing."""

    def __init__(self, target_host: str, target_port: int) -> None:
        import asyncio
        import threading

        self.target = (target_host, target_port)
        self.cut_off = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import asyncio

        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _client(self, reader: object, writer: object) -> None:
        import asyncio

        assert isinstance(reader, asyncio.StreamReader)
        assert isinstance(writer, asyncio.StreamWriter)
        if self.cut_off:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update({writer, up_writer})
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: object, writer: object) -> None:
        import asyncio

        assert isinstance(reader, asyncio.StreamReader)
        assert isinstance(writer, asyncio.StreamWriter)
        try:
            while not self.cut_off and (data := await reader.read(65536)):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)

    def cut(self) -> None:
        def close_all() -> None:
            self.cut_off = True
            for writer in list(self._writers):
                writer.close()
        self._loop.call_soon_threadsafe(close_all)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "cut_off", False)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class Certificates(msgspec.Struct, frozen=True, kw_only=True):
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    """Made with the `openssl` command line (EC P-256, valid two days)."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=m27-test-ca")
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                       "extendedKeyUsage=serverAuth\n"),
                            ("client", "extendedKeyUsage=clientAuth\n")):
        (directory / f"{name}.ext").write_text(extension)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=m27-test-{name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")
    for private in directory.glob("*.key"):
        private.chmod(0o600)
    return Certificates(ca=directory / "ca.pem", server_cert=directory / "server.pem",
                        server_key=directory / "server.key",
                        client_cert=directory / "client.pem",
                        client_key=directory / "client.key")


def api_tls_config(certs: Certificates) -> str:
    """The m2config `[api]` section for mutual TLS on every gRPC server and client."""
    return ("[api]\n"
            f"tls_cert = {certs.server_cert}\ntls_key = {certs.server_key}\n"
            f"tls_client_ca = {certs.ca}\ntls_ca = {certs.ca}\n"
            f"client_cert = {certs.client_cert}\nclient_key = {certs.client_key}\n")


def tls_config(certs: Certificates) -> str:
    """An m2config with mutual TLS for NATS (server and clients) and the API."""
    return ("[nats]\n"
            f"server_cert = {certs.server_cert}\nserver_key = {certs.server_key}\n"
            f"tls_ca = {certs.ca}\n"
            f"tls_cert = {certs.client_cert}\ntls_key = {certs.client_key}\n"
            + api_tls_config(certs))


@contextlib.contextmanager
def embedded(root: Path, *, tls: bool, nodes: int = 1, gpus: str = "sim:1") -> Iterator[Path]:
    """`m27 up` in `root/home` as a user runs it, on loopback, or with mutual TLS for NATS
    and the API; `M27_HOME` and `M27_CONFIG` name it meanwhile (the CLI, clients and the
    services read them). Yields the home."""
    config = root / "m2config"
    config.write_text(tls_config(make_certificates(root / "tls")) if tls else "")
    home = root / "home"
    saved = {name: os.environ.get(name) for name in ("M27_HOME", "M27_CONFIG")}
    os.environ["M27_HOME"], os.environ["M27_CONFIG"] = str(home), str(config)
    try:
        system.up(home, nodes=nodes, gpus=gpus, config=load_config(config).config.nats)
        try:
            yield home
        finally:
            system.down(home)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def stored(bus: NatsBus, stream: str) -> list[tuple[str, bytes]]:
    """Every message a JetStream stream holds now, as (subject, data), oldest first."""
    info = await bus.js.stream_info(stream)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await bus.js.get_msg(stream, seq)
        except NotFoundError:  # deleted or expired since the info was read
            continue
        found.append((msg.subject or "", msg.data or b""))
    return found


def nats_settings() -> NatsSection:
    """The `[nats]` settings of the system `embedded` brought up (its TLS files, if any)."""
    return load_config(Path(os.environ["M27_CONFIG"])).config.nats
