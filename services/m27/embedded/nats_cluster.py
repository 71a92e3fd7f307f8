"""Several nats-servers on one machine as one JetStream cluster (`m27 up --nats-cluster 3`,
the clustered-NATS tests and bench).

Each member has its own server name, store, client port and route port; every member's
`routes` lists all of them, so any one can be killed and started again with the same
config and it rejoins. JetStream answers only once the members have elected a meta leader,
which `wait_for_jetstream` waits for (`$JS.API.INFO` answered).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Final, TypeVar

import nats.errors
import nats.js.errors

from m27.common.bus import Access, connect
from m27.common.errors import BusError, M27Error
from m27.embedded.nats_server import (
    ClusterRoutes,
    NatsServer,
    ServerTls,
    pid_alive,
    stop_process,
)

T = TypeVar("T")

CLUSTER_NAME: Final = "m27"
#: How long a fresh cluster may take to elect its meta leader (about a second on loopback;
#: a member restarted into a running cluster, a few).
JETSTREAM_TIMEOUT_S: Final = 30.0
SIZES: Final = (1, 3, 5)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now (held together while they are chosen)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class NatsCluster:
    """`size` nats-servers on `host` forming one JetStream cluster, each under
    `root/server-<i>`, named `<prefix><i>`. Ports are chosen once, so a member stopped or
    killed comes back on the same ones (`restart`)."""

    def __init__(self, root: Path, size: int, *, host: str = "127.0.0.1",
                 prefix: str = "m27-", authorization: str = "",
                 tls: ServerTls | None = None, advertise: bool = True) -> None:
        """`advertise=False`: clients learn no member addresses from the servers (they
        keep to the URLs they were given: `ClusterRoutes.advertise`)."""
        if size not in SIZES:
            raise M27Error(f"a NATS cluster has 1, 3 or 5 servers (an odd number, for a "
                           f"quorum), not {size}")
        ports = free_ports(2 * size, host)
        clients, route_ports = ports[:size], ports[size:]
        routes = tuple(f"nats-route://{host}:{port}" for port in route_ports)
        self.root = root
        self.detached = False
        self.servers = [
            NatsServer(root / f"server-{i}", host=host, port=clients[i - 1],
                       server_name=f"{prefix}{i}", authorization=authorization, tls=tls,
                       cluster=ClusterRoutes(name=CLUSTER_NAME,
                                             listen=f"{host}:{route_ports[i - 1]}",
                                             routes=routes, advertise=advertise))
            for i in range(1, size + 1)]

    @property
    def urls(self) -> list[str]:
        """Each member's client URL (once started)."""
        return [server.url or "" for server in self.servers]

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated: what `[nats] url` takes for failover."""
        return ",".join(self.urls)

    def start(self, *, detached: bool = False) -> list[str]:
        """Start every member (each waits until it accepts clients); their URLs. JetStream
        is ready later: `wait_for_jetstream`."""
        self.detached = detached
        try:
            for server in self.servers:
                server.start(detached=detached)
        except M27Error:
            self.stop(timeout=5)
            raise
        return self.urls

    def restart(self, index: int) -> str:
        """Start member `index` (0-based) again, on its ports and store; its URL."""
        return self.servers[index].start(detached=self.detached)

    def kill(self, index: int) -> None:
        """SIGKILL member `index`, as a crash would end it, and reap it."""
        server = self.servers[index]
        if server.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)
        server.process = None

    def alive(self, index: int) -> bool:
        pid = self.servers[index].pid
        return pid is not None and self.servers[index].process is not None and pid_alive(pid)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every member at once, then wait for each (SIGKILL after `timeout`)."""
        running = [s for s in self.servers if s.process is not None]
        for server in running:
            assert server.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.process.pid, signal.SIGTERM)
        for server in running:
            assert server.process is not None
            stop_process(server.process.pid, timeout, child=server.process)
            server.process = None


async def wait_for_jetstream(url: str, *, access: Access | None = None,
                             timeout: float = JETSTREAM_TIMEOUT_S, stream: str = "") -> None:
    """Until JetStream at `url` answers (`$JS.API.INFO`): in a cluster, once its members
    have a meta leader; with `stream`, until that stream answers too (it has a leader).
    BusError saying so after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    nc = await connect(url, name="m27-wait-jetstream", timeout=timeout, access=access)
    try:
        js = nc.jetstream(timeout=2.0)
        while True:
            try:
                await js.account_info()
                if stream:
                    await js.stream_info(stream)
                return
            except nats.js.errors.NotFoundError:
                return  # answered: there is no such stream
            except (TimeoutError, nats.errors.Error) as exc:
                if loop.time() >= deadline:
                    raise BusError(f"JetStream at {url} has no meta leader after "
                                   f"{timeout:.0f}s ({exc or type(exc).__name__}): are "
                                   "most of its servers up?") from exc
            await asyncio.sleep(0.1)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def run_blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end from synchronous code, even code that an event loop is
    running (a test's): on a loop of its own in a worker thread."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
